"""Pure tensor terms the policy losses share: PPO's clipped objective, the k3 KL estimator,
entropy, and sums over the real tokens of an ``[R, B]`` (response position, sample) micro-batch.

Flags are validated once, by their configuration (``config/grpo.py``'s ``LossConfig``); these
functions only assert their invariants.
"""

import torch

from megatron_longstraw.config.grpo import AGGREGATIONS


def clip_objective(ratio: torch.Tensor, advantages: torch.Tensor, clip_eps_low: float, clip_eps_high: float):
    """PPO/DAPO clipped objective to minimize, elementwise over broadcast ``ratio``/``advantages``
    (per token for GRPO, per sequence for GSPO).

    Returns ``(loss, clipped_low, clipped_high)``: ``loss = -min(r A, clip(r, 1-low, 1+high) A)``;
    the boolean masks mark where the clipped branch wins and the gradient vanishes (as verl counts
    them): low where ``A < 0`` and ``r < 1 - low``, high where ``A > 0`` and ``r > 1 + high``.
    """
    assert 0 <= clip_eps_low < 1 and clip_eps_high >= 0, (clip_eps_low, clip_eps_high)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    clipped_low = (advantages < 0) & (ratio < 1 - clip_eps_low)
    clipped_high = (advantages > 0) & (ratio > 1 + clip_eps_high)
    return loss, clipped_low, clipped_high


def kl_k3(logprobs_RB: torch.Tensor, ref_logprobs_RB: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of ``KL(pi || ref)`` per token: ``exp(d) - d - 1`` with
    ``d = ref_logp - logp``; unbiased for samples of ``pi``, and never negative."""
    delta_RB = ref_logprobs_RB - logprobs_RB
    return torch.exp(delta_RB) - delta_RB - 1


def entropy_from_logits(logits_RBV: torch.Tensor) -> torch.Tensor:
    """Entropy ``[R, B]`` (fp32) of the softmax over the last dimension (reference implementation;
    the model computes it vocabulary-parallel)."""
    logits_RBV = logits_RBV.float()
    logp_RBV = torch.log_softmax(logits_RBV, dim=-1)
    return -(logp_RBV.exp() * logp_RBV).sum(-1)


def masked(per_token_RB: torch.Tensor, real_RB: torch.Tensor) -> torch.Tensor:
    """``per_token_RB`` with every padded position zero (even where it holds inf or NaN)."""
    assert per_token_RB.shape == real_RB.shape and real_RB.dtype == torch.bool, \
        (tuple(per_token_RB.shape), tuple(real_RB.shape), real_RB.dtype)
    return torch.where(real_RB, per_token_RB, torch.zeros_like(per_token_RB))


def sequence_means(per_token_RB: torch.Tensor, real_RB: torch.Tensor) -> torch.Tensor:
    """Each sample's mean ``[B]`` over its own real tokens."""
    lengths_B = real_RB.sum(0).clamp(min=1).to(per_token_RB.dtype)
    return masked(per_token_RB, real_RB).sum(0) / lengths_B


def aggregated_sum(per_token_RB: torch.Tensor, real_RB: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Scalar sum of per-sample terms of a micro-batch, before the normalizer: the sum over real
    tokens (``"token"``) or the sum of each sequence's mean over its real tokens (``"sequence"``)."""
    assert aggregation in AGGREGATIONS, aggregation
    if aggregation == "token":
        return masked(per_token_RB, real_RB).sum()
    return sequence_means(per_token_RB, real_RB).sum()
