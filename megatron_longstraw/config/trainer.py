"""``train_grpo.py``'s configuration: every group of the trainer, checked across groups.

Defaults are the embedded demo: the tiny hybrid model (``qwen3.5-debug``) on the built-in
synthetic retrieval task, a few steps on CPU (or GPU), wandb offline, a checkpoint under runs/.
What needs torch, the files or another module (the parallel layout's ranks excepted) is checked
by ``training/arguments.py`` after parsing.
"""

from dataclasses import dataclass, field
from typing import Optional

from megatron_longstraw.config.data import DataConfig, EvaluationConfig, PromptLengthSchedule
from megatron_longstraw.config.grpo import GRPOConfig, LossConfig, RewardConfig, RolloutConfig
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.config.longstraw import LongStrawConfig
from megatron_longstraw.config.model import ModelConfig, PrecisionConfig
from megatron_longstraw.config.node import ConfigNode
from megatron_longstraw.config.parallel import ParallelConfig
from megatron_longstraw.config.training import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainingConfig


@dataclass(frozen=True)
class TrainerConfig(ConfigNode):
    """One GRPO run on LongStraw (``python train_grpo.py --help`` lists every flag by group)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    longstraw: LongStrawConfig = field(default_factory=LongStrawConfig)
    kernels: KernelOptions = field(default_factory=KernelOptions)
    world_size: int = 1
    """Processes of the run (the launcher's ``WORLD_SIZE``)."""

    def check(self) -> None:
        dp = self.data_parallel_size  # the layout against the world size
        if self.training.global_batch_size % dp:
            raise ValueError(f"--global-batch-size {self.training.global_batch_size} must be divisible by the "
                             f"data-parallel size {dp}")
        if self.optimizer.lr_warmup_iters >= self.lr_decay_iters:
            raise ValueError(f"--lr-warmup-iters {self.optimizer.lr_warmup_iters} must be below --lr-decay-iters "
                             f"{self.lr_decay_iters} (default: --train-iters)")
        if self.precision.fp8_format and self.model.transformer_impl != "transformer_engine":
            raise ValueError("--fp8-format needs --transformer-impl transformer_engine")
        self._check_synthetic_flags()
        if self.grpo.dynamic_sampling and self.parallel.expert_model_parallel_size > 1:
            raise ValueError(f"--dynamic-sampling does not run with --expert-model-parallel-size "
                             f"{self.parallel.expert_model_parallel_size}: a rank that redraws captures while the "
                             "others replay, and expert-parallel ranks must run their MoE passes in step")
        if self.parallel.pipeline_model_parallel_size > 1 and self.longstraw.replay_mode != "longstraw":
            raise ValueError(f"--pipeline-model-parallel-size {self.parallel.pipeline_model_parallel_size} needs "
                             "--replay-mode longstraw (the full-graph baseline has no pipeline path)")
        if self.parallel.context_parallel_size > 1 and self.longstraw.replay_mode != "longstraw":
            raise ValueError("--context-parallel-size > 1 needs --replay-mode longstraw (the full-graph "
                             "baseline has no CP path)")

    def _check_synthetic_flags(self) -> None:
        """``--prompt-length-schedule`` and ``--eval-*`` are the synthetic task's (internal rollouts)."""
        if self.data.prompt_length_schedule is not None and not self.synthetic_task:
            raise ValueError(f"{PromptLengthSchedule.FLAG} is for the synthetic task (--data-path synthetic, "
                             "internal rollouts)")
        evaluation = self.evaluation
        if evaluation.enabled:
            flag = "--eval-interval" if evaluation.eval_interval else "--skip-train"
            if not self.synthetic_task:
                raise ValueError(f"{flag} evaluates on held-out prompts of the synthetic task (--data-path "
                                 "synthetic, internal rollouts)")
            if evaluation.eval_prompts < 1 or evaluation.eval_prompts % self.data_parallel_size:
                raise ValueError(f"--eval-prompts {evaluation.eval_prompts} must be a positive multiple of the "
                                 f"data-parallel size {self.data_parallel_size}")

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel replicas: the world size over TP x CP x PP."""
        return self.parallel.sizes.validate(self.world_size)

    @property
    def groups_per_rank(self) -> int:
        """Prompt groups each data-parallel rank trains per step."""
        return self.training.global_batch_size // self.data_parallel_size

    @property
    def lr_decay_iters(self) -> int:
        """``--lr-decay-iters``, or ``--train-iters`` when unset."""
        return self.optimizer.decay_iters(self.training.train_iters)

    @property
    def synthetic_task(self) -> bool:
        """Whether the prompts come from the built-in synthetic task (internal rollouts)."""
        return self.data.synthetic and self.rollout.rollout_source == "internal"

    @property
    def curriculum(self) -> Optional[PromptLengthSchedule]:
        """The prompt-length schedule (``--prompt-length-schedule``), or ``None``."""
        return self.data.curriculum

    @property
    def eval_lengths(self) -> list[int]:
        """The held-out prompt lengths: ``--eval-prompt-lengths``, else the training length (the
        schedule's last stage)."""
        given = self.evaluation.given_lengths
        if given is not None:
            return given
        curriculum = self.curriculum
        return [curriculum.stages[-1][0] if curriculum else self.data.synthetic_prompt_length]

    @property
    def exact(self) -> bool:
        """``--prompt-gradient exact``."""
        return self.longstraw.exact
