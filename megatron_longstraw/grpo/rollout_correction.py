"""Rollout correction: importance weights between the sampler's and the trainer's log-probs.

The responses were drawn by a sampler (vLLM, SGLang, or the trainer's own decoder) whose
probabilities differ from the policy the trainer scores (``old_logprobs``): kernels, precision,
an FP8 server, another temperature. The policy-gradient term then carries the importance ratio
``r = pi_old / pi_sampler`` per token, detached:

- ``tis`` (truncated importance sampling): each token's policy term weighted by ``min(r, cap)``;
- ``mis`` (masked importance sampling): a token whose ratio lies outside ``[1 / cap, cap]`` is left
  out of the policy term (weight 0), the others keep their ratio as weight;
- ``none``: weight 1 (the gap is still measured and logged).

The sequence-level losses (``gspo``) take the ratio per response as the geometric mean of its
tokens' ratios (``exp(mean log r)``, as GSPO's own sequence ratio), truncated or masked the same
way. Pure functions of ``[R, B]`` tensors (response position, sample).
"""

import math

import torch

from megatron_longstraw.grpo.loss_terms import sequence_means


def _weights(log_ratio: torch.Tensor, mode: str, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, corrected)`` of log-ratios of any shape (in fp32 at least)."""
    log_ratio = log_ratio.to(torch.promote_types(log_ratio.dtype, torch.float32))
    if mode == "tis":
        ratio = log_ratio.exp()  # inf past fp32's range: the cap takes it
        return ratio.clamp(max=cap), ratio > cap
    if mode == "mis":
        keep = log_ratio.abs() <= math.log(cap)
        return torch.where(keep, log_ratio.exp(), torch.zeros_like(log_ratio)), ~keep
    assert mode == "none", mode
    return torch.ones_like(log_ratio), torch.zeros_like(log_ratio, dtype=torch.bool)


def token_weights(old_logprobs_RB: torch.Tensor, sampler_logprobs_RB: torch.Tensor, mode: str,
                  cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(weight_RB, corrected_RB)``: the weight of each token's policy term and where
    it was truncated (``tis``) or masked (``mis``)."""
    return _weights(old_logprobs_RB - sampler_logprobs_RB, mode, cap)


def sequence_weights(old_logprobs_RB: torch.Tensor, sampler_logprobs_RB: torch.Tensor, real_RB: torch.Tensor,
                     mode: str, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-response ``(weight_B, corrected_B)`` from the geometric mean of its real tokens' ratios."""
    log_ratio_RB = old_logprobs_RB - sampler_logprobs_RB
    return _weights(sequence_means(log_ratio_RB.to(torch.promote_types(log_ratio_RB.dtype, torch.float32)), real_RB),
                    mode, cap)
