"""The ``dr_grpo`` policy loss (Dr. GRPO, "Understanding R1-Zero-Like Training", arXiv 2503.20783):
GRPO's per-token terms without its two normalizations.

- no length normalization: each token's term is summed, and the sum divided by a *constant*
  normalizer, ``--max-response-length`` times the responses of the global batch (the paper's
  constant). On a rank the normalizer is ``--max-response-length`` x this rank's responses of the
  step; DDP's average over the data-parallel ranks makes it the global count, so no rescale is
  needed at the end of the step.
- no std normalization of advantages: reward - group mean. ``--advantage-normalization``
  defaults to ``none`` under this loss and ``group-std`` is refused (``check_config``), as is
  ``--loss-aggregation sequence``.

The clipped surrogate, k3 KL and entropy terms are GRPO's (``grpo/losses/grpo.py``).
"""

from megatron_longstraw.config.grpo import LossConfig
from megatron_longstraw.grpo.loss_base import StepShape
from megatron_longstraw.grpo.losses.grpo import GRPOLoss
from megatron_longstraw.grpo.registry import register_policy_loss


@register_policy_loss("dr_grpo")
class DrGRPOLoss(GRPOLoss):
    """``--loss-type dr_grpo``: ``GRPOLoss`` with ``token`` aggregation over the constant
    normalizer ``--max-response-length`` x responses (module doc)."""

    summary = "Dr. GRPO: token sum over max-response-length x responses, no std normalization"
    aggregations = ("token",)
    advantage_normalizations = ("none",)

    @classmethod
    def group_normalizer(cls, config: LossConfig, step: StepShape, num_responses: int) -> float:
        """``--max-response-length`` x this rank's responses of the step."""
        return float(step.max_response_length) * num_responses * step.groups_per_rank

    @classmethod
    def finish_step(cls, metrics: dict, config: LossConfig, step: StepShape) -> float:
        """``loss/total`` = ``loss/sum / dp_size`` (DDP's average); the gradients stay as they are."""
        metrics["loss/total"] = metrics.pop("loss/sum") / step.data_parallel_size
        return 1.0
