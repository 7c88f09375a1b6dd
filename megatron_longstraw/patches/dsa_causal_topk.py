"""Fix: DSA top-k that breaks exact score ties by position, so every token's selection is causal.

Megatron's ``fused_qk_topk_naive`` (like HF's indexer) takes ``torch.topk`` of the causally
masked index scores. Exact ties are common: with ReLU scoring (GLM-5) every key whose per-head
dot products are all <= 0 scores exactly 0, so a query with fewer than ``index_topk`` positive
keys picks among tied zeros. Which tied keys ``torch.topk`` returns depends on the row length,
i.e. on how many (masked) tokens FOLLOW the query: a prompt token's selection, and so its hidden
state, would change with the response length, and no prompt state could reproduce the
full-sequence forward. This patch keeps Megatron's scores and masking and ranks by (score
descending, position ascending): the selection is a function of the visible scores alone.
Megatron's fused GPU top-k kernels are not affected (their tie order is a GPU-path issue).
"""

import importlib

import torch

# the package re-exports names from dsa; patch the module the DSA code looks names up in
dsa = importlib.import_module("megatron.core.transformer.experimental_attention_variant.dsa")
_ORIGINAL = dsa.fused_qk_topk_naive


def causal_topk(index_scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of the ``k`` largest scores along the last dim; ties -> lower index."""
    values, order = index_scores.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], order[..., :k]


def fused_qk_topk_causal(*args, **kwargs):
    """Megatron's ``fused_qk_topk_naive`` (same arguments and scores) with ``causal_topk``."""
    index_scores, topk_indices = _ORIGINAL(*args, **kwargs)
    k = topk_indices.shape[-1]
    if k == 0:
        return index_scores, topk_indices
    values, indices = causal_topk(index_scores, k)
    return index_scores, indices.masked_fill(values == float("-inf"), -1)


def needed() -> bool:
    """Always: the tie order is device-independent semantics."""
    return True


def apply() -> None:
    """Route Megatron's naive DSA top-k through the position tie-break."""
    dsa.fused_qk_topk_naive = fused_qk_topk_causal


def revert() -> None:
    """Restore Megatron's function."""
    dsa.fused_qk_topk_naive = _ORIGINAL
