"""Streaming reads and writes of safetensors files, one tensor at a time.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {}}``
padded with spaces to a multiple of 8, then the raw little-endian tensor bytes. The library's
``save_file`` serializes a whole shard at once and ``safe_open`` maps the file (its pages count
in the process's resident memory while mapped); reading with ``readinto`` straight into a
tensor and writing tensors as they come keeps the resident memory at the tensors in flight.
Files written here are checked with the ``safetensors`` library in the tests.
"""

import ctypes
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    nbytes: int

    def meta(self) -> torch.Tensor:
        """A meta tensor with this entry's dtype and shape (no memory)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of a safetensors file; ``ValueError`` naming the file if it is not one."""
    try:
        with open(path, "rb") as f:
            size = f.read(8)
            if len(size) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", size)
            if length > _MAX_HEADER:
                raise ValueError(f"{path}: not a safetensors file (header length {length})")
            header = json.loads(f.read(length))
            file_size = os.fstat(f.fileno()).st_size
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read safetensors header ({err})") from None
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        entry = TensorEntry(Path(path), DTYPES[info["dtype"]], tuple(info["shape"]),
                            8 + length + begin, end - begin)
        expected = entry.meta().numel() * entry.meta().element_size()
        if expected != entry.nbytes or entry.begin + entry.nbytes > file_size:
            raise ValueError(f"{path}: tensor {name!r} has inconsistent offsets (file truncated?)")
        entries[name] = entry
    return entries


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """Read one tensor into fresh memory (no mapping of the file; the storage stays resizable,
    which ``tensor.numpy()`` would forbid)."""
    out = torch.empty(entry.nbytes, dtype=torch.uint8)
    with open(entry.file, "rb", buffering=0) as f:
        f.seek(entry.begin)
        view = memoryview((ctypes.c_char * entry.nbytes).from_address(out.data_ptr())).cast("B")
        done = 0
        while done < entry.nbytes:
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{entry.file}: unexpected end of file")
            done += n
    return out.view(entry.dtype).reshape(entry.shape)


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor; the names, dtypes and shapes come first.

    ``add`` must be called once per declared tensor, in the declared order.
    """

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.order = [name for name, _, _ in specs]
        header, offset, self.sizes = {}, 0, {}
        for name, dtype, shape in specs:
            nbytes = torch.empty(shape, dtype=dtype, device="meta").numel() * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self.sizes[name] = (dtype, tuple(shape))
            offset += nbytes
        header["__metadata__"] = metadata or {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.file = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.next = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor (its name, dtype and shape as declared)."""
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise AssertionError(f"tensor {name!r} written out of order")
        if (tensor.dtype, tuple(tensor.shape)) != self.sizes[name]:
            raise AssertionError(f"tensor {name!r}: {tensor.dtype} {tuple(tensor.shape)} "
                                 f"differs from the declared {self.sizes[name]}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))
        self.next += 1

    def close(self) -> None:
        """Flush and fsync; every declared tensor must have been written."""
        if self.next != len(self.order):
            raise AssertionError(f"{self.path}: {len(self.order) - self.next} tensors not written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
