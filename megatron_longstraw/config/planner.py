"""``tools/plan_budget.py``'s configuration: the trainer's groups that shape a step, the GPUs,
and what to answer.

The planner takes the trainer's own flags (``--num-generations``, ``--prompt-gradient``, the
parallel sizes, ...) with the trainer's defaults, so a launch's flags plan that launch; the
layout sizes, ``--prompt-chunk-size`` and ``--recompute-granularity`` it is not given it
searches (``planning/report.py``).
"""

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from megatron_longstraw.config.grpo import GRPOConfig, LossConfig, RolloutConfig
from megatron_longstraw.config.longstraw import LongStrawConfig
from megatron_longstraw.config.model import ModelConfig
from megatron_longstraw.config.node import ConfigNode
from megatron_longstraw.config.parallel import ParallelConfig
from megatron_longstraw.config.training import TrainingConfig
from megatron_longstraw.config.workload import WorkloadConfig


@dataclass(frozen=True)
class HardwareConfig(ConfigNode):
    """The GPUs of a planned run."""

    TITLE: ClassVar[str] = "GPUs"

    num_gpus: int = 1
    """GPUs of the run."""

    gpu: Optional[str] = field(default=None, metadata={"help_from": "megatron_longstraw.planning.hardware:gpu_help"})
    """GPU model (default h200 unless --gpu-memory-gb and --gpu-tflops describe another):"""

    gpu_memory_gb: Optional[float] = None
    """Usable GPU memory in GB of 10^9 bytes (overrides --gpu's; an H200 has 150.1 usable)."""

    gpu_tflops: Optional[float] = None
    """Dense bf16 peak TFLOP/s (overrides --gpu's)."""

    def check(self) -> None:
        for flag, value in (("--num-gpus", self.num_gpus), ("--gpu-memory-gb", self.gpu_memory_gb),
                            ("--gpu-tflops", self.gpu_tflops)):
            if value is not None and value <= 0:
                raise ValueError(f"{flag} {value}: must be positive")


@dataclass(frozen=True)
class PlanQueryConfig(ConfigNode):
    """What the planner answers."""

    TITLE: ClassVar[str] = "planner"

    data_parallel_size: Optional[int] = None
    """Fix DP (default: every size the GPUs allow)."""

    precision: Literal["bf16", "fp32", "bench"] = "bf16"
    """bf16: the trainer with --bf16 (fp32 gradients, main weights and Adam); fp32: without;
    bench: tools/bench_longstraw.py (bf16 gradients and Adam moments)."""

    max_prompt: bool = False
    """Find the largest prompt (multiple of 1,024 tokens) some layout fits."""

    max_step_seconds: Optional[float] = None
    """With --max-prompt: the step must also end within this many seconds."""

    json: bool = False
    """Print the plans as JSON instead of a table."""

    top: int = 0
    """Show only the first N layouts (0: all)."""

    against: Optional[str] = field(default=None, metadata={"metavar": "DIR"})
    """Instead: every benchmark run in DIR (bench_*.json) beside its plan, as a markdown table."""

    fit_rates: Optional[str] = field(default=None, metadata={"metavar": "DIR"})
    """Instead: the kernel rates of planning/kernels.py read off DIR's runs by least squares."""

    def check(self) -> None:
        if self.data_parallel_size is not None and self.data_parallel_size < 1:
            raise ValueError(f"a parallel size must be at least 1 (dp={self.data_parallel_size})")
        if self.max_step_seconds is not None and (not self.max_prompt or self.max_step_seconds <= 0):
            raise ValueError("--max-step-seconds needs --max-prompt and a positive number of seconds")
        if self.top < 0:
            raise ValueError(f"--top {self.top}: must be 0 (all) or more")


@dataclass(frozen=True)
class SearchedParallelConfig(ParallelConfig):
    """The parallel sizes of a planner question: the sizes not given are searched, so each given
    size is checked alone (``--num-virtual-stages-per-pipeline-rank 2`` without
    ``--pipeline-model-parallel-size`` asks for the layouts of PP > 1); the search drops the
    combinations that do not hold together (``planning/layouts.py``)."""

    def check(self) -> None:
        self.sizes.check_each()


_LAYOUT_ABOUT = ("the sizes given fix the layout; every valid size of the others is searched (the defaults "
                 "shown are the trainer's)")


@dataclass(frozen=True)
class PlannerConfig(ConfigNode):
    """One planner question: a model, a step's shape and the GPUs."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={
        "flags": ("model", "hf_config", "model_family", "num_layers", "recompute_granularity"),
        "about": "--recompute-granularity not given: both settings are tried (the default shown is the trainer's)"})
    parallel: SearchedParallelConfig = field(default_factory=SearchedParallelConfig,
                                             metadata={"about": _LAYOUT_ABOUT})
    training: TrainingConfig = field(default_factory=TrainingConfig, metadata={"flags": ("global_batch_size",)})
    grpo: GRPOConfig = field(default_factory=GRPOConfig, metadata={"flags": ("num_generations",)})
    loss: LossConfig = field(default_factory=LossConfig, metadata={"flags": ("kl_coef",)})
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"flags": ("rollout_source",)})
    longstraw: LongStrawConfig = field(default_factory=LongStrawConfig, metadata={
        "flags": ("prompt_chunk_size", "replay_micro_batch_size", "prompt_gradient"),
        "about": "--prompt-chunk-size not given: several sizes are tried (the default shown is the trainer's)"})
    workload: WorkloadConfig = field(default_factory=WorkloadConfig, metadata={
        "flags": ("prompt_length", "response_length")})
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    query: PlanQueryConfig = field(default_factory=PlanQueryConfig)
