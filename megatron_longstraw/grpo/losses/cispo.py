"""The ``cispo`` policy loss (CISPO, MiniMax-M1, arXiv 2506.13585): REINFORCE with a clipped,
stop-gradient importance weight.

Per token ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp`` with ``r = exp(logp - old_logp)``:
unlike the PPO clip, a clipped token keeps its gradient, ``-w A`` times that of ``logp``, only
its weight ``w`` is bounded. Token-level normalization over the global batch, as GRPO's ``token``
aggregation (the only one it takes): the plain sum per group, then ``finish_step`` scales the
gradients by ``dp_size / global_tokens``. The clip range comes from the shared
``--clip-eps-low``/``--clip-eps-high`` (the paper bounds only the upper side; a
``--clip-eps-low`` close to 1 leaves the lower side effectively open). KL and entropy terms are GRPO's.
"""

import torch

from megatron_longstraw.grpo.loss_base import ReplayBatch
from megatron_longstraw.grpo.losses.grpo import GRPOLoss
from megatron_longstraw.grpo.registry import register_policy_loss


@register_policy_loss("cispo")
class CISPOLoss(GRPOLoss):
    """``--loss-type cispo``: ``GRPOLoss`` with the clipped-IS-weight REINFORCE term per token
    (module doc). ``clip_frac_low``/``_high`` count the tokens whose weight was clipped."""

    summary = "REINFORCE with a clipped stop-gradient IS weight"
    aggregations = ("token",)

    def policy_terms(self, batch: ReplayBatch):
        """``(loss_RB, clipped_low_RB, clipped_high_RB)``: ``-sg(w) A logp`` and where ``r`` fell
        below ``1 - eps_low`` / above ``1 + eps_high``."""
        ratio_RB = torch.exp(batch.logprobs_RB.detach() - batch.old_logprobs_RB)
        weight_RB = ratio_RB.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high)
        loss_RB = -weight_RB * batch.advantages_B.unsqueeze(0) * batch.logprobs_RB
        return loss_RB, ratio_RB < 1 - self.clip_eps_low, ratio_RB > 1 + self.clip_eps_high
