"""The ``sft`` loss: supervised fine-tuning on given responses, through the same capture and
replay as the policy losses and in both ``--prompt-gradient`` modes (a warm start before GRPO).

Per token ``-logp`` of the given response, aggregated as GRPO's (``token``: the global batch's
token mean; ``sequence``: each response's mean, averaged): the negative log-likelihood of the
responses after their prompt. The responses are not sampled: the trainer takes the record's
answer ids (the synthetic task's value and EOS, or a JSONL record's token-id ``answer``) as the
one response of its prompt, or a rollout file's responses as they are
(``PolicyLoss.trains_on_given_responses``). Rewards are still computed and logged (a given
answer scores what the reward says of it), advantages play no part. The KL and entropy terms
are GRPO's; the clip range has nothing to act on (no ratio enters the loss), and the rollout
correction, which has nothing to act on either, is refused when set (so is dynamic sampling, by
the trainer, for every loss that trains on given responses).
"""

import torch

from megatron_longstraw.config.grpo import LossConfig
from megatron_longstraw.grpo.loss_base import ReplayBatch
from megatron_longstraw.grpo.losses.grpo import GRPOLoss
from megatron_longstraw.grpo.registry import register_policy_loss


@register_policy_loss("sft")
class SFTLoss(GRPOLoss):
    """``--loss-type sft``: ``GRPOLoss`` whose policy term is the negative log-likelihood of each
    token (module doc); the clip fractions it logs are 0."""

    summary = "negative log-likelihood of the records' given answers or responses: a warm start"
    advantage_normalizations = ("none",)
    trains_on_given_responses = True

    @classmethod
    def check_config(cls, config: LossConfig) -> None:
        super().check_config(config)
        if config.rollout_correction != "none":
            raise ValueError(f"--loss-type sft trains on given responses: --rollout-correction "
                             f"{config.rollout_correction} has no sampler to correct for")

    def policy_terms(self, batch: ReplayBatch):
        """``(-logp, no clip, no clip)`` per token."""
        unclipped_RB = torch.zeros_like(batch.real_RB)
        return -batch.logprobs_RB, unclipped_RB, unclipped_RB
