"""The ``grpo`` policy loss (``--loss-type grpo``): clipped surrogate, k3 KL penalty, entropy
bonus, global-batch aggregation; and the checked functions of its math for direct callers.

Tensors are ``[R, B]`` (response position, sample), the replay micro-batch layout. A micro-batch's
loss is backpropagated at once and gradients accumulate over micro-batches and prompt groups, so
the loss is a sum of per-sample terms divided by a ``normalizer`` fixed for the whole global batch.

Normalization in the trainer: each group's state is freed before the next group is captured, so
the token count of the whole global batch is unknown while groups replay. ``token`` aggregation
therefore backpropagates the plain sum over tokens (normalizer 1) and ``finish_step`` returns
``dp_size / global_tokens``, the factor the accumulated gradients are scaled by before Megatron's
DDP averages them over data-parallel ranks (exact token mean over the global batch, before
clipping). ``sequence`` averages each response over its tokens and divides by this rank's
responses of the step; DDP's average makes it the mean over all responses.

The terms shared with the other losses live in ``grpo/loss_terms.py``. The checked functions
below validate their hyper-parameters as the flags are (``LossConfig``).
"""

from typing import Sequence

import torch

from megatron_longstraw.config.grpo import LossConfig
from megatron_longstraw.grpo.loss_base import PolicyLoss, ReplayBatch, StepShape
from megatron_longstraw.grpo.loss_terms import AGGREGATIONS, aggregated_sum, clip_objective
from megatron_longstraw.grpo.registry import register_policy_loss


def clipped_surrogate(logprobs_RB: torch.Tensor, old_logprobs_RB: torch.Tensor, advantages_B: torch.Tensor,
                      clip_eps_low: float, clip_eps_high: float):
    """PPO/DAPO clipped surrogate per token, to be minimized.

    Returns ``(loss_RB, clipped_low_RB, clipped_high_RB)``: ``loss = -min(r A, clip(r, 1-low, 1+high) A)``
    with ``r = exp(logp - old_logp)``; the boolean masks mark where the clipped branch wins and
    the gradient vanishes (as verl counts them): low where ``A < 0`` and ``r < 1 - low``, high
    where ``A > 0`` and ``r > 1 + high``. Checks the clip range (``ValueError``); the losses call
    the unchecked ``loss_terms.clip_objective``, their flags validated at start-up.
    """
    LossConfig(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    ratio_RB = torch.exp(logprobs_RB - old_logprobs_RB)
    return clip_objective(ratio_RB, advantages_B.to(ratio_RB.dtype).unsqueeze(0), clip_eps_low, clip_eps_high)


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"--loss-aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")


def loss_normalizer(response_lengths: Sequence[int], aggregation: str) -> float:
    """Normalizer of a global batch: its real response tokens (``"token"``) or sequences
    (``"sequence"``). If the data-parallel gradient reduction averages over ranks, the caller
    divides the all-rank count by the data-parallel size."""
    _check_aggregation(aggregation)
    if not response_lengths or any(n <= 0 for n in response_lengths):
        raise ValueError(f"response lengths must be positive, got {list(response_lengths)}")
    return float(sum(response_lengths) if aggregation == "token" else len(response_lengths))


def aggregate(per_token_RB: torch.Tensor, mask_RB: torch.Tensor, indices: Sequence[int],
              aggregation: str, normalizer: float) -> torch.Tensor:
    """Scalar sum of per-sample terms over the real tokens of a micro-batch, over ``normalizer``.

    ``"token"``: sum over real tokens / normalizer (= real tokens in the global batch).
    ``"sequence"``: each sequence's mean over its own real tokens, summed / normalizer
    (= sequences in the global batch). Padding is excluded even if it holds inf or NaN. Checks
    its arguments (``ValueError``); the losses call the unchecked ``loss_terms.aggregated_sum``.
    """
    _check_aggregation(aggregation)
    if not normalizer > 0:
        raise ValueError(f"loss normalizer must be > 0, got {normalizer}")
    assert per_token_RB.shape == mask_RB.shape and mask_RB.shape[1] == len(indices), \
        (tuple(per_token_RB.shape), tuple(mask_RB.shape), len(indices))
    return aggregated_sum(per_token_RB, mask_RB > 0, aggregation) / normalizer


@register_policy_loss("grpo")
class GRPOLoss(PolicyLoss):
    """``--loss-type grpo``: per token, clipped surrogate + ``kl_coef`` * k3(pi, ref) -
    ``entropy_coef`` * entropy, aggregated per ``--loss-aggregation`` (``token`` / ``sequence``)
    over the ``normalizer`` (module doc). See ``PolicyLoss`` for the inputs and metrics.
    """

    summary = "clipped surrogate"
    aggregations = AGGREGATIONS
    metric_names = {**PolicyLoss.metric_names, "policy_loss": "loss/policy", "clip_frac_low": "clip/frac_low",
                    "clip_frac_high": "clip/frac_high"}

    @classmethod
    def group_normalizer(cls, config: LossConfig, step: StepShape, num_responses: int) -> float:
        """``token``: 1 (``finish_step`` rescales by the global token count); ``sequence``: this
        rank's responses of the step."""
        if cls.aggregation_of(config) == "token":
            return 1.0
        return float(num_responses) * step.groups_per_rank

    @classmethod
    def finish_step(cls, metrics: dict, config: LossConfig, step: StepShape) -> float:
        """``token``: ``loss/total`` = ``loss/sum`` over the global batch's ``tokens/response``, and
        the gradients are scaled by ``dp_size / tokens``; ``sequence``: ``loss/sum / dp_size``, no scale."""
        loss_sum = metrics.pop("loss/sum")
        if cls.aggregation_of(config) == "token":  # exact token mean over the global batch
            metrics["loss/total"] = loss_sum / metrics["tokens/response"]
            return step.data_parallel_size / metrics["tokens/response"]
        metrics["loss/total"] = loss_sum / step.data_parallel_size
        return 1.0

    def policy_terms(self, batch: ReplayBatch):
        """``(loss_RB, clipped_low_RB, clipped_high_RB)`` of the policy term per token: the clipped
        surrogate (``clipped_surrogate``)."""
        ratio_RB = torch.exp(batch.logprobs_RB - batch.old_logprobs_RB)
        return clip_objective(ratio_RB, batch.advantages_B.unsqueeze(0), self.clip_eps_low, self.clip_eps_high)

    def loss(self, batch: ReplayBatch) -> torch.Tensor:
        policy_RB, low_RB, high_RB = self.policy_terms(batch)
        policy_RB = self.corrected_tokens(policy_RB, batch)  # the rollout correction's weights
        loss = aggregated_sum(self.regularized(policy_RB, batch), batch.real_RB, self.aggregation) / self.normalizer
        self.add_token_metric("policy_loss", policy_RB, batch.real_RB)
        self.add_token_metric("clip_frac_low", low_RB, batch.real_RB)
        self.add_token_metric("clip_frac_high", high_RB, batch.real_RB)
        return loss
