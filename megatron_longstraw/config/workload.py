"""What a planned or benchmarked step runs: prompt lengths, group sizes, response length (the
``workload`` flag group of the planner and the benchmarks; the trainer's come from its data)."""

from dataclasses import dataclass
from typing import ClassVar

from megatron_longstraw.config.node import ConfigNode


@dataclass(frozen=True)
class WorkloadConfig(ConfigNode):
    """The step's shape where no data gives it."""

    TITLE: ClassVar[str] = "workload"

    prompt_length: int = 1 << 20
    """Prompt tokens."""

    prompt_lengths: tuple[int, ...] = (131072,)
    """Comma-separated prompt lengths, one point each."""

    group_sizes: tuple[int, ...] = (2, 8)
    """Comma-separated G (responses per prompt), one point each."""

    response_length: int = 8192
    """Tokens of each response (every response planned and benchmarked at this length)."""

    def check(self) -> None:
        for flag, values in (("--prompt-length", (self.prompt_length,)), ("--prompt-lengths", self.prompt_lengths),
                             ("--group-sizes", self.group_sizes), ("--response-length", (self.response_length,))):
            if not values or min(values) < 1:
                raise ValueError(f"{flag} must be >= 1, got {','.join(map(str, values)) or 'none'}")
