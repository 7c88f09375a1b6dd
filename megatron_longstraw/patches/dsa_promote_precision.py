"""Fix: DSA's unfused math computes in fp32 or wider, never narrower than its inputs.

Megatron's naive DSA paths cast to fp32 with ``.float()`` (index scores in
``_compute_index_scores``; attention scores and softmax in ``_unfused_absorbed_dsa_fn``), which
for bf16/fp32 inputs is the intended "at least fp32" but for fp64 inputs is a downcast. An fp64
model then rounds to fp32 inside every DSA layer, in a way that depends on the batch shape, so
fp64 tests cannot resolve exactness (e.g. one response at a time vs a padded micro-batch agree
only to ~1e-7). These replacements are Megatron's functions with ``.float()`` replaced by a cast
to ``promote_types(dtype, float32)``: identical for bf16/fp16/fp32, fp64 for fp64.
"""

import importlib
from typing import Optional

import torch

dsa = importlib.import_module("megatron.core.transformer.experimental_attention_variant.dsa")
dsa_masking = importlib.import_module(
    "megatron.core.transformer.experimental_attention_variant.dsa_masking")
_ORIGINALS = {name: getattr(dsa, name) for name in ("_compute_index_scores", "_unfused_absorbed_dsa_fn")}


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def compute_index_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                         use_relu: bool = True) -> torch.Tensor:
    """Megatron's ``_compute_index_scores`` at ``promote_types(dtype, fp32)``: ``[b, sq, sk]``."""
    dtype = _compute_dtype(q, k)
    index_scores = torch.einsum('sbhd,tbd->sbht', q.to(dtype), k.to(dtype))
    if use_relu:
        index_scores = torch.relu(index_scores)
    index_scores = index_scores * weights.unsqueeze(-1)
    return index_scores.sum(dim=2).transpose(0, 1)


def unfused_absorbed_dsa_fn(query, key, topk_indices, softmax_scale: float, v_channels: int,
                            mask: Optional[torch.Tensor] = None,
                            varlen_starts: Optional[torch.Tensor] = None,
                            varlen_ends: Optional[torch.Tensor] = None,
                            key_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Megatron's ``_unfused_absorbed_dsa_fn`` at ``promote_types(dtype, fp32)``."""
    sq, b, np, hn = query.size()
    skv = key.size(0)
    assert key.size(2) == 1, "Absorbed DSA expects MQA key head dimension = 1"
    assert key.size(-1) >= v_channels, "key last dim must contain latent value channels"
    row_mask, varlen_starts, varlen_ends, key_positions = dsa_masking.prepare_sparse_mask_context(
        mask=mask, varlen_starts=varlen_starts, varlen_ends=varlen_ends,
        key_positions=key_positions, sq=sq, sk=skv, b=b, device=query.device)
    dtype = _compute_dtype(query, key)
    q = query.permute(1, 2, 0, 3)
    k = key.permute(1, 2, 3, 0)
    attention_scores = torch.matmul(q.to(dtype), k.to(dtype)) * softmax_scale
    index_mask = torch.full((b, sq, skv), float("-inf"), device=attention_scores.device)
    dsa_masking.scatter_topk_into_index_mask(index_mask, topk_indices, seq_chunk_size=256)
    index_mask = dsa_masking.apply_sparse_validity_to_index_mask(
        index_mask, row_mask=row_mask, varlen_starts=varlen_starts, varlen_ends=varlen_ends,
        key_positions=key_positions)
    attention_scores = attention_scores + index_mask.unsqueeze(1)
    valid_index_mask = torch.isfinite(index_mask)
    attention_scores = dsa_masking.masked_softmax(
        attention_scores.to(dtype), valid_index_mask.unsqueeze(1).expand(b, np, sq, skv), dim=-1)
    value = key[..., :v_channels].permute(1, 2, 0, 3)
    output = torch.matmul(attention_scores.to(value.dtype), value)
    return output.permute(2, 0, 1, 3).contiguous()


_REPLACEMENTS = {"_compute_index_scores": compute_index_scores,
                 "_unfused_absorbed_dsa_fn": unfused_absorbed_dsa_fn}


def needed() -> bool:
    """Always (a no-op below fp64)."""
    return True


def apply() -> None:
    """Install the promoting versions in Megatron's DSA module."""
    for name, function in _REPLACEMENTS.items():
        setattr(dsa, name, function)


def revert() -> None:
    """Restore Megatron's functions."""
    for name, function in _ORIGINALS.items():
        setattr(dsa, name, function)
