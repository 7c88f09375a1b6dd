"""What a built-in reward may need besides the sample itself."""

from dataclasses import dataclass
from typing import Any


@dataclass
class RewardContext:
    """Run-wide inputs of the built-in rewards: the EOS id (``exact_match``), the tokenizer
    (``exact_match`` against a text answer) and the partial-credit weight
    (``synthetic_retrieval``, ``--reward-partial-credit``)."""

    eos_id: int | None = None
    tokenizer: Any = None
    partial_credit: float = 0.0
