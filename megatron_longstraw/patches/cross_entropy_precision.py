"""Fix: Megatron's vocab-parallel cross entropy of fp64 logits stays fp64.

``VocabParallelCrossEntropy.calculate_logits_max`` (used by the unfused and the fused
vocab-parallel cross entropy) starts with ``logits.float()``: "at least fp32" for bf16/fp32, a
downcast for fp64. An fp64 model's log-probs and their gradients then go through fp32, and the
fp32 sums of ``exp`` over each rank's vocabulary shard round differently for TP=2 than for one
rank, so the fp64 tests of TP gradients could not resolve 1e-9 (measured ~1e-7). The replacement
casts to ``promote_types(dtype, float32)``: fp64 stays fp64, identical below fp64 (the same
``.float()``).
"""

import torch
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

_ORIGINAL = VocabParallelCrossEntropy.__dict__["calculate_logits_max"]


def calculate_logits_max(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``(logits, max over the local vocabulary)``, in fp64 for fp64 logits."""
    if vocab_parallel_logits.dtype != torch.float64:
        return _ORIGINAL.__func__(vocab_parallel_logits)
    return vocab_parallel_logits, torch.max(vocab_parallel_logits, dim=-1)[0]


def needed() -> bool:
    """Always (a no-op below fp64)."""
    return True


def apply() -> None:
    """Install the fp64-keeping logits max."""
    VocabParallelCrossEntropy.calculate_logits_max = staticmethod(calculate_logits_max)


def revert() -> None:
    """Restore Megatron's."""
    VocabParallelCrossEntropy.calculate_logits_max = _ORIGINAL
