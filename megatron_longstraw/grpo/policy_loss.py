"""GRPO policy loss: clipped surrogate, k3 KL penalty, entropy bonus, global-batch aggregation.

Tensors are ``[R, B]`` (response position, sample), the replay micro-batch layout. A micro-batch's
loss is backpropagated at once and gradients accumulate over micro-batches and prompt groups, so
the loss is a sum of per-sample terms divided by a ``normalizer`` fixed for the whole global batch.
"""

import math
from typing import Optional, Sequence

import torch

AGGREGATIONS = ("token", "sequence")


def _check_coef(flag: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{flag} must be a finite number >= 0, got {value}")


def validate_loss_args(clip_eps_low: float, clip_eps_high: float, kl_coef: float = 0.0,
                       entropy_coef: float = 0.0, aggregation: str = "token") -> None:
    """Raise ``ValueError`` naming the flag for an invalid loss hyper-parameter."""
    if not 0 <= clip_eps_low < 1:
        raise ValueError(f"--clip-eps-low must be in [0, 1), got {clip_eps_low}")
    if not clip_eps_high >= 0:
        raise ValueError(f"--clip-eps-high must be >= 0, got {clip_eps_high}")
    _check_coef("--kl-coef", kl_coef)
    _check_coef("--entropy-coef", entropy_coef)
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"--loss-aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")


def clipped_surrogate(logprobs_RB: torch.Tensor, old_logprobs_RB: torch.Tensor, advantages_B: torch.Tensor,
                      clip_eps_low: float, clip_eps_high: float):
    """PPO/DAPO clipped surrogate per token, to be minimized.

    Returns ``(loss_RB, clipped_low_RB, clipped_high_RB)``: ``loss = -min(r A, clip(r, 1-low, 1+high) A)``
    with ``r = exp(logp - old_logp)``; the boolean masks mark where the clipped branch wins and
    the gradient vanishes (as verl counts them): low where ``A < 0`` and ``r < 1 - low``, high
    where ``A > 0`` and ``r > 1 + high``.
    """
    validate_loss_args(clip_eps_low, clip_eps_high)
    ratio_RB = torch.exp(logprobs_RB - old_logprobs_RB)
    advantages_1B = advantages_B.to(ratio_RB.dtype).unsqueeze(0)
    unclipped_RB = ratio_RB * advantages_1B
    clipped_RB = ratio_RB.clamp(1 - clip_eps_low, 1 + clip_eps_high) * advantages_1B
    loss_RB = -torch.minimum(unclipped_RB, clipped_RB)
    clipped_low_RB = (advantages_1B < 0) & (ratio_RB < 1 - clip_eps_low)
    clipped_high_RB = (advantages_1B > 0) & (ratio_RB > 1 + clip_eps_high)
    return loss_RB, clipped_low_RB, clipped_high_RB


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


def loss_normalizer(response_lengths: Sequence[int], aggregation: str) -> float:
    """Normalizer of a global batch: its real response tokens (``"token"``) or sequences
    (``"sequence"``). If the data-parallel gradient reduction averages over ranks, the caller
    divides the all-rank count by the data-parallel size."""
    validate_loss_args(0.0, 0.0, aggregation=aggregation)
    if not response_lengths or any(n <= 0 for n in response_lengths):
        raise ValueError(f"response lengths must be positive, got {list(response_lengths)}")
    return float(sum(response_lengths) if aggregation == "token" else len(response_lengths))


def aggregate(per_token_RB: torch.Tensor, mask_RB: torch.Tensor, indices: Sequence[int],
              aggregation: str, normalizer: float) -> torch.Tensor:
    """Scalar sum of per-sample terms over the real tokens of a micro-batch, over ``normalizer``.

    ``"token"``: sum over real tokens / normalizer (= real tokens in the global batch).
    ``"sequence"``: each sequence's mean over its own real tokens, summed / normalizer
    (= sequences in the global batch). Padding is excluded even if it holds inf or NaN.
    """
    validate_loss_args(0.0, 0.0, aggregation=aggregation)
    if not normalizer > 0:
        raise ValueError(f"loss normalizer must be > 0, got {normalizer}")
    assert per_token_RB.shape == mask_RB.shape and mask_RB.shape[1] == len(indices), \
        (tuple(per_token_RB.shape), tuple(mask_RB.shape), len(indices))
    real_RB = mask_RB > 0
    masked_RB = torch.where(real_RB, per_token_RB, torch.zeros_like(per_token_RB))
    if aggregation == "token":
        return masked_RB.sum() / normalizer
    lengths_B = real_RB.sum(0).clamp(min=1).to(masked_RB.dtype)
    return (masked_RB.sum(0) / lengths_B).sum() / normalizer


class GRPOLoss:
    """``loss_fn(logprobs_RB, mask_RB, indices, entropy_RB=None)`` for one prompt group's replay.

    Per token: clipped surrogate + ``kl_coef`` * k3(pi, ref) - ``entropy_coef`` * entropy, then
    ``aggregate``d. ``old_logprobs``/``ref_logprobs`` hold one 1-D tensor per group sample (its
    response length). Detached metric sums accumulate over calls; see ``metrics``.
    """

    # replay hands every call the per-token entropies (``model_steps.loss_of``): they are logged
    # even when ``entropy_coef`` is 0
    needs_entropy = True

    def __init__(self, old_logprobs: Sequence[torch.Tensor], advantages_G: torch.Tensor, *,
                 normalizer: float, ref_logprobs: Optional[Sequence[torch.Tensor]] = None,
                 clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, kl_coef: float = 0.0,
                 entropy_coef: float = 0.0, aggregation: str = "token"):
        validate_loss_args(clip_eps_low, clip_eps_high, kl_coef, entropy_coef, aggregation)
        if not normalizer > 0:
            raise ValueError(f"loss normalizer must be > 0, got {normalizer}")
        if advantages_G.dim() != 1 or advantages_G.numel() != len(old_logprobs):
            raise ValueError(f"{advantages_G.numel()} advantages for {len(old_logprobs)} samples' "
                             "old log-probs")
        if any(t.dim() != 1 or t.numel() == 0 for t in old_logprobs):
            raise ValueError("old log-probs must be one non-empty 1-D tensor per sample")
        if ref_logprobs is not None and [t.shape for t in ref_logprobs] != [t.shape for t in old_logprobs]:
            raise ValueError("reference log-probs must match the old log-probs sample by sample")
        if kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"--kl-coef {kl_coef} needs reference log-probs (ref_logprobs)")
        self.old_logprobs, self.ref_logprobs = list(old_logprobs), ref_logprobs
        self.advantages_G = advantages_G.detach()
        self.clip_eps_low, self.clip_eps_high = clip_eps_low, clip_eps_high
        self.kl_coef, self.entropy_coef = kl_coef, entropy_coef
        self.aggregation, self.normalizer = aggregation, normalizer
        self._sums: dict[str, torch.Tensor] = {}

    def _pad(self, per_sample, indices, lengths, like_RB: torch.Tensor) -> torch.Tensor:
        out_RB = torch.zeros_like(like_RB, requires_grad=False)
        for b, (i, length) in enumerate(zip(indices, lengths)):
            if per_sample[i].numel() != length:
                raise ValueError(f"sample {i}: {per_sample[i].numel()} stored log-probs but "
                                 f"{length} real tokens in the micro-batch")
            out_RB[:length, b] = per_sample[i].detach().to(out_RB)
        return out_RB

    def __call__(self, logprobs_RB: torch.Tensor, mask_RB: torch.Tensor, indices: Sequence[int],
                 entropy_RB: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scalar loss of the micro-batch of group samples ``indices``; accumulates metrics."""
        if self.entropy_coef != 0 and entropy_RB is None:
            raise ValueError(f"--entropy-coef {self.entropy_coef} needs the per-token entropy (entropy_RB)")
        assert logprobs_RB.shape == mask_RB.shape and mask_RB.shape[1] == len(indices)
        real_RB = mask_RB > 0
        lengths = real_RB.sum(0).tolist()
        old_RB = self._pad(self.old_logprobs, indices, lengths, logprobs_RB)
        # padding: new := old, so ratio 1 and k3 0 there, with no inf/NaN to reach the gradient
        logprobs_RB = torch.where(real_RB, logprobs_RB, old_RB)
        advantages_B = self.advantages_G.to(logprobs_RB.device)[list(indices)]
        surrogate_RB, low_RB, high_RB = clipped_surrogate(
            logprobs_RB, old_RB, advantages_B, self.clip_eps_low, self.clip_eps_high)
        per_token_RB = surrogate_RB
        ref_kl_RB = None
        if self.ref_logprobs is not None:
            ref_RB = self._pad(self.ref_logprobs, indices, lengths, logprobs_RB)
            ref_kl_RB = kl_k3(logprobs_RB, ref_RB)
            if self.kl_coef:
                per_token_RB = per_token_RB + self.kl_coef * ref_kl_RB
        if self.entropy_coef:
            per_token_RB = per_token_RB - self.entropy_coef * entropy_RB
        loss = aggregate(per_token_RB, mask_RB, indices, self.aggregation, self.normalizer)
        with torch.no_grad():
            self._accumulate(real_RB, logprobs_RB.detach() - old_RB, surrogate_RB, low_RB, high_RB,
                             ref_kl_RB, entropy_RB)
        return loss

    def _accumulate(self, real_RB, log_ratio_RB, surrogate_RB, low_RB, high_RB, ref_kl_RB, entropy_RB):
        def add(name, value_RB):
            total = torch.where(real_RB, value_RB.detach().float(), 0.0).sum()
            self._sums[name] = self._sums[name] + total if name in self._sums else total

        ratio_RB = log_ratio_RB.exp()
        add("tokens", real_RB)
        add("policy_loss", surrogate_RB)
        add("clip_frac_low", low_RB)
        add("clip_frac_high", high_RB)
        add("approx_kl", ratio_RB - 1 - log_ratio_RB)  # k3 of KL(old || new), samples from old
        add("ratio_mean", ratio_RB)
        ratio_max = torch.where(real_RB, ratio_RB, float("-inf")).max()
        self._sums["ratio_max"] = torch.maximum(self._sums.get("ratio_max", ratio_max), ratio_max)
        if ref_kl_RB is not None:
            add("ref_kl", ref_kl_RB)
        if entropy_RB is not None:
            add("entropy_tokens", real_RB)
            add("entropy", entropy_RB)

    def metrics(self) -> dict[str, float]:
        """Per-real-token means over all calls so far of ``policy_loss`` (surrogate only),
        ``clip_frac_low``/``_high``, ``approx_kl`` (k3 of old vs new policy), ``ref_kl`` (k3 to
        the reference; with ``ref_logprobs`` only), ``entropy`` (when given), ``ratio_mean``;
        plus ``ratio_max`` and ``tokens`` (the weight for combining groups). Empty before a call."""
        if not self._sums:
            return {}
        sums = {name: value.item() for name, value in self._sums.items()}
        tokens, entropy_tokens = sums.pop("tokens"), sums.pop("entropy_tokens", 0.0)
        out = {name: (value if name == "ratio_max" else value / tokens) for name, value in sums.items()}
        if "entropy" in sums:
            out["entropy"] = sums["entropy"] / entropy_tokens
        out["tokens"] = tokens
        return out
