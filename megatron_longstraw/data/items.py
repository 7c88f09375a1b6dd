"""What the datasets hand to the trainer."""

from dataclasses import dataclass

import torch


@dataclass
class PromptItem:
    """One prompt: ``prompt_ids_P`` (1-D LongTensor), an optional answer (text, or token ids as
    ``list[int]``), optional free-form metadata, and ``source`` (``<file>:<line>`` or
    ``synthetic:<index>``) for error messages."""

    prompt_ids_P: torch.Tensor
    answer: str | list[int] | None
    metadata: dict | None
    source: str
