"""What a planned run does, independent of its layout."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_longstraw.config.planner import PlannerConfig
    from megatron_longstraw.config.trainer import TrainerConfig

# bytes per parameter of each precision setting: (weights, gradients, optimizer states)
PRECISIONS = {
    # the trainer with --bf16: bf16 weights, fp32 gradient buffers (Megatron DDP), fp32 main
    # weights and two fp32 Adam moments (Megatron's optimizer)
    "bf16": (2, 4, 12),
    # the trainer without --bf16: fp32 weights, gradients and two Adam moments
    "fp32": (4, 4, 8),
    # the benchmark (tools/bench_longstraw.py): bf16 weights, bf16 gradients, two bf16 Adam moments
    "bench": (2, 2, 4),
}


@dataclass(frozen=True)
class RunShape:
    """One GRPO step's work: prompt, responses, chunking, gradient mode, precision."""

    prompt_length: int
    """Prompt tokens (one prompt group)."""
    response_length: int = 8192
    """Tokens of each response (the longest; replay and decode are planned at this length)."""
    num_generations: int = 8
    """G: responses per prompt."""
    prompt_gradient: str = "detached"
    """``detached`` (replay only) or ``exact`` (state gradients plus the reverse sweep)."""
    chunk_size: int = 32768
    """``--prompt-chunk-size``: capture (and the exact sweep) run the prompt in chunks of this."""
    micro_batch_size: int = 1
    """``--replay-micro-batch-size``: responses replayed together."""
    precision: str = "bf16"
    """A key of ``PRECISIONS``."""
    distributed_optimizer: bool = True
    """``--use-distributed-optimizer``: optimizer states (and main weights) sharded over DP."""
    rollout: str = "internal"
    """``internal`` (decode the G samples from the state) or ``file`` (responses given)."""
    global_batch_size: int = 1
    """Prompt groups per step over all data-parallel ranks."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: under TP the activations between layers are sharded too (without
    it each TP rank keeps the hidden-sized ones whole)."""
    reference_model: bool = False
    """``--kl-coef`` > 0: a frozen copy of the weights for the KL term."""
    recompute: bool = False
    """``--recompute-granularity full``: replay keeps each layer's input only and recomputes the
    layer in backward (one more forward); the exact sweep always runs without it."""

    def __post_init__(self):
        if self.prompt_gradient not in ("detached", "exact"):
            raise ValueError(f"--prompt-gradient {self.prompt_gradient}: choose detached or exact")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision}: choose one of {', '.join(PRECISIONS)}")
        for flag, value in (("--prompt-length", self.prompt_length), ("--response-length", self.response_length),
                            ("--num-generations", self.num_generations), ("--prompt-chunk-size", self.chunk_size),
                            ("--replay-micro-batch-size", self.micro_batch_size),
                            ("--global-batch-size", self.global_batch_size)):
            if value < 1:
                raise ValueError(f"{flag} {value}: must be at least 1")

    @classmethod
    def of(cls, config: "TrainerConfig | PlannerConfig", prompt_length: int, response_length: int,
           precision: str) -> "RunShape":
        """The step of a trainer's or planner's configuration (the groups that shape it: GRPO,
        loss, rollout, LongStraw, parallel, model) with the prompt and response lengths and the
        precision its command gives."""
        longstraw = config.longstraw
        return cls(prompt_length=prompt_length, response_length=response_length,
                   num_generations=config.grpo.num_generations, prompt_gradient=longstraw.prompt_gradient,
                   chunk_size=longstraw.prompt_chunk_size, micro_batch_size=longstraw.replay_micro_batch_size,
                   precision=precision, distributed_optimizer=config.parallel.use_distributed_optimizer,
                   rollout="internal" if config.rollout.rollout_source == "internal" else "file",
                   global_batch_size=config.training.global_batch_size, recompute=config.model.recompute == "full",
                   sequence_parallel=config.parallel.sequence_parallel, reference_model=config.loss.kl_coef > 0)

    @property
    def exact(self) -> bool:
        return self.prompt_gradient == "exact"

    @property
    def num_chunks(self) -> int:
        """Capture chunks of the prompt."""
        return -(-self.prompt_length // self.chunk_size)
