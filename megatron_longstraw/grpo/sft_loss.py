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
correction and dynamic sampling, which have nothing to act on either, are refused when set.
"""

import torch

from megatron_longstraw.grpo.loss_base import ReplayBatch
from megatron_longstraw.grpo.policy_loss import GRPOLoss


class SFTLoss(GRPOLoss):
    """``--loss-type sft``: ``GRPOLoss`` whose policy term is the negative log-likelihood of each
    token (module doc); the clip fractions it logs are 0."""

    name = "sft"
    advantage_normalizations = ("none",)
    trains_on_given_responses = True

    @classmethod
    def validate_args(cls, args) -> None:
        super().validate_args(args)
        if args.rollout_correction != "none":
            raise ValueError(f"--loss-type sft trains on given responses: --rollout-correction "
                             f"{args.rollout_correction} has no sampler to correct for")
        if getattr(args, "dynamic_sampling", False):
            raise ValueError("--loss-type sft trains on given responses: --dynamic-sampling has no group "
                             "rewards to act on")

    def policy_terms(self, batch: ReplayBatch):
        """``(-logp, no clip, no clip)`` per token."""
        unclipped_RB = torch.zeros_like(batch.real_RB)
        return -batch.logprobs_RB, unclipped_RB, unclipped_RB
