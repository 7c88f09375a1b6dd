"""The ``gspo`` policy loss (GSPO, "Group Sequence Policy Optimization", arXiv 2507.18071): the
importance ratio and its clipping at the sequence level.

Per response ``i``: ``s_i = exp(mean_t(logp - old_logp))`` (the length-normalized sequence
likelihood ratio), loss ``-min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``, averaged over
the responses of the global batch (on a rank: over its responses of the step; DDP's average
makes it the global mean). The gradient of an unclipped response is ``-A_i s_i / |y_i|`` on each
of its tokens' log-probs, that of GSPO-token with ``s_i,t = sg[s_i] pi / sg[pi]`` (the same value
and gradient). A replay micro-batch holds whole responses (``longstraw/micro_batches.py``), so
``s_i`` is computed inside one call.

The clip range comes from the shared ``--clip-eps-low``/``--clip-eps-high``, whose defaults are
sized for token ratios; GSPO's sequence ratios want far smaller ones (the paper: 3e-4 / 4e-4).
KL and entropy terms enter per response as the mean over its tokens. The rollout correction
weighs each response by its geometric-mean ratio (``grpo/rollout_correction.py``). ``--loss-aggregation``
is ``sequence`` (the only one it takes).
"""

import torch

from megatron_longstraw.config.grpo import LossConfig
from megatron_longstraw.grpo.loss_base import PolicyLoss, ReplayBatch, StepShape
from megatron_longstraw.grpo.loss_terms import clip_objective, sequence_means
from megatron_longstraw.grpo.registry import register_policy_loss


@register_policy_loss("gspo")
class GSPOLoss(PolicyLoss):
    """``--loss-type gspo``: the sequence-level clipped surrogate (module doc). Its
    ``policy_loss`` and clip fractions are per-sequence means; ``sequence_ratio_mean`` /
    ``_max`` log ``s_i``, the token-level ``ratio_*`` and ``approx_kl`` stay per token."""

    summary = "sequence-level ratio and clip"
    aggregations = ("sequence",)
    per_sequence_metrics = ("policy_loss", "clip_frac_low", "clip_frac_high", "sequence_ratio_mean",
                            "correction_weight", "corrected")
    metric_names = {**PolicyLoss.metric_names, "policy_loss": "loss/policy", "clip_frac_low": "clip/frac_low",
                    "clip_frac_high": "clip/frac_high", "sequence_ratio_mean": "ratio/sequence_mean",
                    "sequence_ratio_max": "ratio/sequence_max"}

    @classmethod
    def group_normalizer(cls, config: LossConfig, step: StepShape, num_responses: int) -> float:
        """This rank's responses of the step."""
        return float(num_responses) * step.groups_per_rank

    @classmethod
    def finish_step(cls, metrics: dict, config: LossConfig, step: StepShape) -> float:
        """``loss/total`` = ``loss/sum / dp_size`` (DDP's average); the gradients stay as they are."""
        metrics["loss/total"] = metrics.pop("loss/sum") / step.data_parallel_size
        return 1.0

    def loss(self, batch: ReplayBatch) -> torch.Tensor:
        real_RB = batch.real_RB
        ratio_B = torch.exp(sequence_means(batch.logprobs_RB - batch.old_logprobs_RB, real_RB))
        surrogate_B, low_B, high_B = clip_objective(ratio_B, batch.advantages_B, self.clip_eps_low,
                                                    self.clip_eps_high)
        surrogate_B = self.corrected_sequences(surrogate_B, batch)  # the rollout correction's weights
        per_sample_B = surrogate_B
        if self.kl_coef or self.entropy_coef:
            regularizer_RB = self.regularized(torch.zeros_like(batch.logprobs_RB), batch)
            per_sample_B = per_sample_B + sequence_means(regularizer_RB, real_RB)
        self.add_sequence_metric("policy_loss", surrogate_B)
        self.add_sequence_metric("clip_frac_low", low_B)
        self.add_sequence_metric("clip_frac_high", high_B)
        self.add_sequence_metric("sequence_ratio_mean", ratio_B)
        self.add_max_metric("sequence_ratio_max", ratio_B.max())
        return per_sample_B.sum() / self.normalizer
