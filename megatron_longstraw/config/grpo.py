"""GRPO: the group, the policy loss, the rollouts and the reward (their flag groups)."""

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from megatron_longstraw.config.node import ConfigNode

Aggregation = Literal["token", "sequence"]
AdvantageNormalization = Literal["group-std", "none"]
RolloutCorrection = Literal["none", "tis", "mis"]
AGGREGATIONS = Aggregation.__args__
NORMALIZATIONS = AdvantageNormalization.__args__
CORRECTIONS = RolloutCorrection.__args__


@dataclass(frozen=True)
class GRPOConfig(ConfigNode):
    """The prompt group: its size and which groups are kept."""

    TITLE: ClassVar[str] = "GRPO"

    num_generations: int = 4
    """G: responses per prompt."""

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a prompt group whose G rewards are all equal (zero advantages) is
    dropped once scored and the next prompt drawn in its place (logged:
    dynamic_sampling/skipped_frac)."""

    dynamic_sampling_max_draws: int = 4
    """With --dynamic-sampling: prompts drawn at most per group of the step; the last draw is
    trained whatever its rewards."""

    def check(self) -> None:
        if self.num_generations < 2:  # every loss trains on grpo/advantages.py's group_advantages
            raise ValueError(f"--num-generations must be >= 2, got {self.num_generations}: advantages are "
                             "group-relative (each reward minus its group's mean), so a group of one sample has "
                             "advantage 0 and nothing trains")
        if self.dynamic_sampling_max_draws < 1:
            raise ValueError(f"--dynamic-sampling-max-draws must be >= 1, got {self.dynamic_sampling_max_draws}")


@dataclass(frozen=True)
class LossConfig(ConfigNode):
    """The policy loss and its terms (each loss checks the ones it reads: ``check_config``)."""

    TITLE: ClassVar[str] = "policy loss"

    loss_type: str = field(default="grpo", metadata={"metavar": "NAME",
                                                     "help_from": "megatron_longstraw.grpo.registry:loss_help"})
    """Policy loss: a name registered with @register_policy_loss, or module:Class for a PolicyLoss
    subclass outside the package (imported from sys.path or the working directory)."""

    clip_eps_low: float = 0.2
    """Ratio floor 1 - eps, shared by every loss (gspo clips sequence ratios: ~3e-4)."""

    clip_eps_high: float = 0.28
    """Ratio ceiling 1 + eps, shared by every loss (gspo clips sequence ratios: ~4e-4)."""

    kl_coef: float = 0.0
    """Coefficient of the KL penalty to a frozen reference model (kept only when > 0)."""

    loss_aggregation: Optional[Aggregation] = None
    """How per-token terms sum into the loss: token (over every token of the global batch) or
    sequence (each response's mean) (default: the loss's own: token; gspo: sequence, the only one
    it takes; dr_grpo and cispo take only token)."""

    advantage_normalization: Optional[AdvantageNormalization] = None
    """group-std: each reward minus its group's mean, over the group's std; none: minus the mean only
    (default: the loss's own: group-std; dr_grpo and sft: none, the only one they take)."""

    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus."""

    rollout_correction: RolloutCorrection = "none"
    """Importance correction between the sampler's log-probs and the trainer's: tis weighs each
    token's policy term by min(pi_old / pi_sampler, cap), mis leaves out tokens whose ratio is
    outside [1/cap, cap] and weighs the others by it; needs 'logprobs' in every --rollout-path
    record (internal rollouts record their own)."""

    rollout_correction_cap: float = 2.0
    """The cap C of --rollout-correction (a number >= 1)."""

    def check(self) -> None:
        if not 0 <= self.clip_eps_low < 1:
            raise ValueError(f"--clip-eps-low must be in [0, 1), got {self.clip_eps_low}")
        if not self.clip_eps_high >= 0:
            raise ValueError(f"--clip-eps-high must be >= 0, got {self.clip_eps_high}")
        for flag, value in (("--kl-coef", self.kl_coef), ("--entropy-coef", self.entropy_coef)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{flag} must be a finite number >= 0, got {value}")
        if not (math.isfinite(self.rollout_correction_cap) and self.rollout_correction_cap >= 1):
            raise ValueError(f"--rollout-correction-cap must be a finite number >= 1, got "
                             f"{self.rollout_correction_cap}")


@dataclass(frozen=True)
class RolloutConfig(ConfigNode):
    """Where a group's responses come from and how they are sampled."""

    TITLE: ClassVar[str] = "rollout"

    max_response_length: int = 8
    """Most tokens of a sampled response."""

    temperature: float = 1.0
    """Sampling temperature; 0: greedy."""

    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens of this much probability."""

    decode_cuda_graphs: bool = True
    """Replay each decode step of internal rollouts and evaluation from a CUDA graph where the model
    and layout allow it (a GPU; no tensor/context/pipeline/expert parallelism, MoE layers, FP8 or
    learned position embedding; every stateful layer taking fixed shapes: Qwen3.5's do, GLM-5's do
    not; rollouts of at least 4 steps); elsewhere decoding runs eagerly; --no-decode-cuda-graphs:
    always eagerly."""

    rollout_source: Literal["internal", "jsonl"] = "internal"
    """internal: sample G responses from the policy; jsonl: prompts and responses from
    --rollout-path."""

    rollout_path: Optional[str] = None
    """JSONL of prompts with G responses (--rollout-source jsonl; default: unset)."""

    def check(self) -> None:
        if self.max_response_length < 1:
            raise ValueError(f"--max-response-length must be >= 1, got {self.max_response_length}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.rollout_source == "jsonl" and not self.rollout_path:
            raise ValueError("--rollout-source jsonl needs --rollout-path")


@dataclass(frozen=True)
class RewardConfig(ConfigNode):
    """How a response is scored."""

    TITLE: ClassVar[str] = "reward"

    reward_fn: str = "synthetic_retrieval"
    """Builtin name, or module:function (imported from sys.path or the working directory); called
    once at start-up on the first record, so a broken one fails before training."""

    reward_partial_credit: float = 0.0
    """synthetic_retrieval: credit c in [0, 1) times the correct fraction of a wrong value."""
