"""The benchmarks' configuration: ``tools/bench_longstraw.py``'s root, the output folder every
benchmark writes to, and how the micro-benchmarks time a call."""

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.config.longstraw import LongStrawConfig
from megatron_longstraw.config.model import ModelConfig, PrecisionConfig
from megatron_longstraw.config.node import ConfigNode
from megatron_longstraw.config.parallel import ParallelConfig
from megatron_longstraw.config.workload import WorkloadConfig

BENCH_MODES = ("longstraw", "full")


@dataclass(frozen=True)
class BenchOutputConfig(ConfigNode):
    """Where a benchmark writes its results (JSON, Markdown, a PNG where it plots)."""

    TITLE: ClassVar[str] = "output"

    output_dir: str = "docs/bench"
    """Folder for the results."""

    tag: str = ""
    """Suffix for the output file names."""


@dataclass(frozen=True)
class TimingConfig(ConfigNode):
    """How a micro-benchmark times one measured call (``tools/bench_linear_fp8.py``,
    ``tools/bench_fp8_attention_calls.py``)."""

    TITLE: ClassVar[str] = "timing"

    repeats: int = 10
    """Timed repetitions of each measured call, after one warm-up; their mean is reported."""

    def check(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")


@dataclass(frozen=True)
class LongStrawBenchConfig(ConfigNode):
    """What ``tools/bench_longstraw.py`` measures beside the workload."""

    TITLE: ClassVar[str] = "benchmark"

    modes: tuple[str, ...] = BENCH_MODES
    """Comma-separated: longstraw (capture once, replay each response) and/or full (the full graph
    per response)."""

    full_prompt_lengths: Optional[tuple[int, ...]] = None
    """Prompt lengths for the full-graph mode (default: --prompt-lengths)."""

    full_max_group: int = 1
    """Full mode replays at most this many responses (its time is per sample)."""

    warmup_prompt_length: int = 65536
    """Prompt tokens of an unrecorded point first (in each mode or variant), so kernel compilation
    and autotuning (minutes on a fresh host) count in no measured point; 0 skips it."""

    memory_limit_gb: Optional[float] = None
    """Let the process allocate at most this many GB (10^9 bytes, as tools/plan_budget.py's
    --gpu-memory-gb) of the GPU (torch.cuda.set_per_process_memory_fraction): every point runs, and
    is planned, as on a GPU with that much memory."""

    def check(self) -> None:
        bad = sorted(set(self.modes) - set(BENCH_MODES))
        if bad or not self.modes:
            raise ValueError(f"--modes: unknown mode(s) {bad}; use longstraw and/or full")
        if self.warmup_prompt_length < 0:
            raise ValueError(f"--warmup-prompt-length must be >= 0, got {self.warmup_prompt_length}")
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise ValueError(f"--memory-limit-gb {self.memory_limit_gb}: must be positive")


@dataclass(frozen=True)
class BenchmarkConfig(ConfigNode):
    """``tools/bench_longstraw.py``: LongStraw against the full graph, time and memory per point."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={
        "flags": ("model", "num_layers", "max_position_embeddings", "yarn_factor", "transformer_impl")})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={
        "flags": ("context_parallel_size", "pipeline_model_parallel_size", "num_virtual_stages_per_pipeline_rank"),
        "about": "launch with torchrun --nproc-per-node N for N > 1; LongStraw mode only"})
    precision: PrecisionConfig = field(default_factory=PrecisionConfig, metadata={
        "flags": ("fp8_format", "fp8_recipe", "fp8_attention")})
    longstraw: LongStrawConfig = field(default_factory=LongStrawConfig, metadata={
        "flags": ("prompt_chunk_size", "replay_micro_batch_size", "prompt_gradient")})
    workload: WorkloadConfig = field(default_factory=WorkloadConfig, metadata={
        "flags": ("prompt_lengths", "group_sizes", "response_length")})
    bench: LongStrawBenchConfig = field(default_factory=LongStrawBenchConfig)
    output: BenchOutputConfig = field(default_factory=BenchOutputConfig)
    kernels: KernelOptions = field(default_factory=KernelOptions, metadata={
        "about": "the attention kernels' backend and block sizes"})

    def check(self) -> None:
        if self.precision.fp8_format and self.model.transformer_impl != "transformer_engine":
            raise ValueError("--fp8-format needs --transformer-impl transformer_engine")
        for flag, size in (("--context-parallel-size", self.parallel.context_parallel_size),
                           ("--pipeline-model-parallel-size", self.parallel.pipeline_model_parallel_size)):
            if size > 1 and "full" in self.bench.modes:
                raise ValueError(f"{flag} {size}: the full-graph mode runs on one rank; use --modes longstraw")

    @property
    def full_prompt_lengths(self) -> tuple[int, ...]:
        """The full-graph mode's prompt lengths (``--full-prompt-lengths``, else ``--prompt-lengths``)."""
        return self.bench.full_prompt_lengths or self.workload.prompt_lengths
