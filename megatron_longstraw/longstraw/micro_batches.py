"""Responses into replay micro-batches: padding, the split by ``--replay-micro-batch-size``, and
the loss-function interface every replay path calls (``replay``, ``full_graph``, ``pipeline``)."""

import math
from typing import Callable, Iterator, Sequence

import torch

# loss_fn(logprobs_RB, mask_RB, sample_indices) -> scalar; summed over micro-batches, so it must be
# a sum of per-sample terms with any normalization fixed for the whole group. A loss with a true
# ``needs_entropy`` attribute is also given ``entropy_RB=`` (see ``model_steps.loss_of``).
LossFn = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


def pad_responses(responses: Sequence[torch.Tensor], pad_id: int = 0):
    """Right-pad 1-D token tensors into ``ids_BR`` and a float ``mask_RB`` of real tokens."""
    if not responses or any(r.dim() != 1 or r.numel() == 0 for r in responses):
        raise ValueError("every response must be a non-empty 1-D token tensor")
    length = max(r.numel() for r in responses)
    ids_BR = responses[0].new_full((len(responses), length), pad_id)
    mask_RB = torch.zeros(length, len(responses), device=responses[0].device)
    for i, r in enumerate(responses):
        ids_BR[i, : r.numel()] = r
        mask_RB[: r.numel(), i] = 1.0
    return ids_BR, mask_RB


def micro_batches(responses: Sequence[torch.Tensor], micro_batch_size: int) -> Iterator[tuple]:
    """``(ids_BR, mask_RB, indices)`` for each run of ``micro_batch_size`` responses (the last may
    be shorter), each padded to its own longest response."""
    if micro_batch_size < 1:
        raise ValueError(f"--replay-micro-batch-size must be >= 1, got {micro_batch_size}")
    for start in range(0, len(responses), micro_batch_size):
        indices = list(range(start, min(start + micro_batch_size, len(responses))))
        yield (*pad_responses([responses[i] for i in indices]), indices)


def uniform_micro_batches(responses: Sequence[torch.Tensor], micro_batch_size: int) -> list[tuple]:
    """``(ids_BR, mask_RB, indices)`` per micro-batch, every one ``micro_batch_size`` rows of the
    same length (the last padded with empty rows, whose ``indices`` are left out): the shapes a
    pipeline schedule's point-to-point transfers expect."""
    if micro_batch_size < 1:
        raise ValueError(f"--replay-micro-batch-size must be >= 1, got {micro_batch_size}")
    ids_BR, mask_RB = pad_responses(responses)
    count = math.ceil(len(responses) / micro_batch_size)
    rows = count * micro_batch_size
    if rows > len(responses):
        ids_BR = torch.cat([ids_BR, ids_BR.new_zeros(rows - len(responses), ids_BR.shape[1])])
        mask_RB = torch.cat([mask_RB, mask_RB.new_zeros(mask_RB.shape[0], rows - len(responses))], dim=1)
    batches = []
    for start in range(0, rows, micro_batch_size):
        indices = [i for i in range(start, start + micro_batch_size) if i < len(responses)]
        batches.append((ids_BR[start:start + micro_batch_size], mask_RB[:, start:start + micro_batch_size], indices))
    return batches
