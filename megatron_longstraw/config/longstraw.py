"""How LongStraw runs a group: capture chunks, replay micro-batches, the prompt gradient (the ``LongStraw`` flag group)."""

from dataclasses import dataclass
from typing import ClassVar, Literal

from megatron_longstraw.config.node import ConfigNode

PromptGradient = Literal["detached", "exact"]


@dataclass(frozen=True)
class LongStrawConfig(ConfigNode):
    """Capture once, replay each response."""

    TITLE: ClassVar[str] = "LongStraw"

    prompt_chunk_size: int = 32768
    """Prompt tokens per no-grad capture chunk (memory: the state plus one chunk)."""

    replay_micro_batch_size: int = 1
    """Responses replayed (forward + backward) at a time against the prompt state."""

    replay_mode: Literal["longstraw", "full"] = "longstraw"
    """longstraw: replay against the captured state; full: the full-graph baseline (prompt +
    response per micro-batch, for comparison)."""

    no_plan_check: bool = False
    """Start even when the budget planner predicts a per-GPU peak over the GPU's memory
    (tools/plan_budget.py; the plan's line is printed either way)."""

    prompt_gradient: PromptGradient = "detached"
    """detached: the prompt state is a constant (LongStraw); exact: replay accumulates the state's
    gradients over the group, then one chunked backward through the prompt gives the full graph's
    gradient (with --replay-mode full: plain backprop through prompt + response with nothing
    detached)."""

    def check(self) -> None:
        for flag, value in (("--prompt-chunk-size", self.prompt_chunk_size),
                            ("--replay-micro-batch-size", self.replay_micro_batch_size)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")

    @property
    def exact(self) -> bool:
        """``--prompt-gradient exact``."""
        return self.prompt_gradient == "exact"

    @property
    def exact_sweep(self) -> bool:
        """Whether the group ends with the reverse sweep through the prompt (exact prompt gradients
        on LongStraw replay; the full-graph baseline backpropagates through the prompt itself)."""
        return self.exact and self.replay_mode == "longstraw"
