"""Block-scaled FP8 checkpoints (GLM-5-FP8, Qwen3.6-27B-FP8), read as bf16.

Their ``config.json`` has ``quantization_config: {"quant_method": "fp8", "weight_block_size":
[128, 128], "activation_scheme": "dynamic", ...}``; each quantized weight ``X.weight`` (E4M3) comes
with ``X.weight_scale_inv`` (one fp32 factor per block of ``weight_block_size`` rows x columns,
the last blocks of a ragged side short) that dequantizes it: ``weight * scale_inv`` computed in
fp32, rounded to bf16 (DeepSeek's ``weight_dequant``, transformers' ``Fp8Dequantize``). The other
tensors (norms, embeddings, the router) are stored unquantized. ``hf_folder.HFFolder`` reads such
a folder through ``BlockFP8``: the scales disappear from its names, each FP8 weight reads
dequantized, one tensor at a time, and its config loses ``quantization_config`` (what the
Megatron checkpoint and an export hold is a bf16 model).
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEQUANTIZED_DTYPE = torch.bfloat16


def dequantize_blocks(weight_RC: torch.Tensor, scale_inv_rc: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = DEQUANTIZED_DTYPE) -> torch.Tensor:
    """``weight_RC * scale_inv`` of its block, in fp32, rounded to ``dtype``; a block of rows at a
    time (memory: the result plus one block row in fp32)."""
    rows, cols = weight_RC.shape
    block_rows, block_cols = block
    assert scale_inv_rc.shape == (math.ceil(rows / block_rows), math.ceil(cols / block_cols)), \
        (tuple(weight_RC.shape), tuple(scale_inv_rc.shape), block)
    out_RC = torch.empty(rows, cols, dtype=dtype)
    for r, start in enumerate(range(0, rows, block_rows)):
        scale_C = scale_inv_rc[r].float().repeat_interleave(block_cols)[:cols]
        out_RC[start:start + block_rows] = (weight_RC[start:start + block_rows].float() * scale_C).to(dtype)
    return out_RC


@dataclass(frozen=True)
class BlockFP8:
    """The block-scaled FP8 format of a checkpoint (its ``quantization_config``)."""

    block: tuple[int, int]

    @classmethod
    def of_config(cls, hf: dict, where: str) -> Optional["BlockFP8"]:
        """The format of a config (``None``: not quantized); ``ValueError`` naming ``where`` and the
        field for one this reader does not take."""
        quant = hf.get("quantization_config")
        if quant is None:
            text = hf.get("text_config")
            quant = text.get("quantization_config") if isinstance(text, dict) else None
        if quant is None:
            return None
        method = quant.get("quant_method")
        if method != "fp8":
            raise ValueError(f"{where}: quantization_config.quant_method {method!r} is not supported "
                             "(block-scaled 'fp8' checkpoints are dequantized on import)")
        block = quant.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{where}: quantization_config.weight_block_size must be two positive integers, "
                             f"got {block!r}")
        scheme = quant.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"{where}: quantization_config.activation_scheme {scheme!r} is not supported "
                             "(only 'dynamic': no activation scales)")
        return cls(block=(block[0], block[1]))

    def scales(self, entries: dict, describe) -> dict[str, str]:
        """``{FP8 weight: its scale's name}`` over a folder's tensors ``entries`` (name -> entry
        with ``dtype``, ``shape``, ``file``); ``ValueError`` naming the file of a weight without its
        scale, a scale without its weight, or a scale of the wrong shape. ``describe(entry)``
        names the file of an entry."""
        pairs = {}
        for name, entry in entries.items():
            if entry.dtype not in FP8_DTYPES:
                continue
            scale = name + SCALE_SUFFIX
            if scale not in entries:
                raise ValueError(f"{describe(entry)}: FP8 weight {name!r} has no {scale!r} "
                                 "(block-scaled FP8 needs one scale per block)")
            if len(entry.shape) != 2:
                raise ValueError(f"{describe(entry)}: FP8 weight {name!r} has shape {entry.shape}; "
                                 "block scales need a 2-D weight")
            wanted = tuple(math.ceil(n / b) for n, b in zip(entry.shape, self.block))
            if tuple(entries[scale].shape) != wanted:
                raise ValueError(f"{describe(entries[scale])}: {scale!r} has shape {tuple(entries[scale].shape)}; "
                                 f"a weight of {entry.shape} in blocks of {list(self.block)} needs {wanted}")
            pairs[name] = scale
        for name, entry in entries.items():
            if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] not in pairs:
                raise ValueError(f"{describe(entry)}: scale {name!r} belongs to no FP8 weight")
        return pairs


def without_quantization(hf: dict) -> dict:
    """The config of the dequantized model: ``quantization_config`` removed (top level and text)."""
    out = {k: v for k, v in hf.items() if k != "quantization_config"}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "quantization_config"}
    return out
