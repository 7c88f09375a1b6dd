"""An HF model folder: ``config.json`` plus ``model.safetensors`` or sharded safetensors with
``model.safetensors.index.json``; tensors are listed from the headers and read one at a time. A
block-scaled FP8 checkpoint reads as the bf16 model it stands for (``fp8_blocks.py``)."""

import json
from pathlib import Path

import torch

from megatron_longstraw.checkpointing.fp8_blocks import DEQUANTIZED_DTYPE, BlockFP8, dequantize_blocks, without_quantization
from megatron_longstraw.checkpointing.safetensors_io import TensorEntry, read_header, read_tensor
from megatron_longstraw.models.hf_config import read_config_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class HFFolder:
    """The tensors of an HF folder by name (from the index and the shard headers)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ValueError(f"--load {self.folder}: no such folder")
        self.config = read_config_json(self.folder / "config.json")
        self.entries: dict[str, TensorEntry] = {}
        index = self.folder / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{index}: not a safetensors index ({err!r})") from None
            headers = {}
            for name, file in weight_map.items():
                path = self.folder / file
                if file not in headers:
                    if not path.is_file():
                        raise ValueError(f"{index}: shard {file!r} (holding {name!r}) is missing")
                    headers[file] = read_header(path)
                if name not in headers[file]:
                    raise ValueError(f"{path}: tensor {name!r} listed in {INDEX_NAME} is not in the shard")
                self.entries[name] = headers[file][name]
            for file, header in headers.items():
                unlisted = sorted(set(header) - set(weight_map))
                if unlisted:
                    raise ValueError(f"{self.folder / file}: tensor {unlisted[0]!r} is missing "
                                     f"from {INDEX_NAME}")
        elif (self.folder / SINGLE_NAME).is_file():
            self.entries = read_header(self.folder / SINGLE_NAME)
        else:
            raise ValueError(f"--load {self.folder}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
        self.fp8 = BlockFP8.of_config(self.config, str(self.folder / "config.json"))
        self.scales: dict[str, str] = {}  # FP8 weight -> its scale
        if self.fp8 is not None:
            self.scales = self.fp8.scales(self.entries, lambda entry: entry.file)
            self.config = without_quantization(self.config)

    def names(self) -> list[str]:
        """Tensor names in index order (an FP8 checkpoint's scales left out: they are read with
        their weights)."""
        scales = set(self.scales.values())
        return [name for name in self.entries if name not in scales]

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor with the stored dtype (an FP8 weight's: bf16) and shape."""
        meta = self.entries[name].meta()
        return meta.to(DEQUANTIZED_DTYPE) if name in self.scales else meta

    def read(self, name: str) -> torch.Tensor:
        """The tensor's data (fresh memory; an FP8 weight dequantized)."""
        if name in self.scales:
            return dequantize_blocks(read_tensor(self.entries[name]), read_tensor(self.entries[self.scales[name]]),
                                     self.fp8.block)
        return read_tensor(self.entries[name])

    def nbytes(self) -> int:
        """Total bytes of all tensors."""
        return sum(e.nbytes for e in self.entries.values())
