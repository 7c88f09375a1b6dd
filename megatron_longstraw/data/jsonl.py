"""JSONL plumbing shared by the prompt and external-rollout datasets.

``JsonlIndex`` records only the byte offset and 1-based line number of every non-blank line, so
a file of million-token prompts is never held in memory: a record is re-read and parsed when it
is needed. The ``check_*`` helpers validate one field and raise a ``ValueError`` that starts with
``<file>:<line>:``.
"""

import json
import math
import os

import torch


class JsonlIndex:
    """Byte offsets and line numbers of the non-blank lines of a JSONL file."""

    def __init__(self, path: str, flag: str):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise ValueError(f"{flag} {self.path}: no such file")
        self.offsets: list[int] = []
        self.line_numbers: list[int] = []
        offset = 0
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    self.offsets.append(offset)
                    self.line_numbers.append(lineno)
                offset += len(line)
        if not self.offsets:
            raise ValueError(f"{flag} {self.path}: the file holds no records")

    def __len__(self) -> int:
        return len(self.offsets)

    def where(self, i: int) -> str:
        """``<file>:<line>`` of record ``i``, the prefix of every error about it."""
        return f"{self.path}:{self.line_numbers[i]}"

    def read(self, i: int) -> dict:
        """Record ``i`` parsed; a ``ValueError`` naming file and line for bad JSON or a
        non-object."""
        with open(self.path, "rb") as f:
            f.seek(self.offsets[i])
            raw = f.readline()
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            detail = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else err
            raise ValueError(f"{self.where(i)}: invalid JSON ({detail})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{self.where(i)}: expected a JSON object, got {type(obj).__name__}")
        return obj


def check_keys(obj: dict, where: str, allowed: tuple[str, ...]) -> None:
    """Refuse keys outside ``allowed`` (catches typos such as ``"anwser"``)."""
    unknown = [key for key in obj if key not in allowed]
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(allowed)})")


def check_ids(value, where: str, field: str, vocab_size: int) -> torch.Tensor:
    """A non-empty JSON list of token ids in ``[0, vocab_size)`` as a 1-D LongTensor."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: {field!r} must be a list of token ids, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{where}: {field!r} is empty")
    if not all(type(x) is int for x in value):
        bad = next(x for x in value if type(x) is not int)
        raise ValueError(f"{where}: {field!r} holds {bad!r}; token ids must be integers")
    ids_T = torch.tensor(value, dtype=torch.long)
    return check_id_range(ids_T, where, field, vocab_size)


def check_id_range(ids_T: torch.Tensor, where: str, field: str, vocab_size: int) -> torch.Tensor:
    """``ids_T`` unchanged if every id lies in ``[0, vocab_size)``."""
    low, high = int(ids_T.min()), int(ids_T.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{where}: {field!r} holds token id {bad}, outside the vocabulary "
                         f"[0, {vocab_size})")
    return ids_T


def check_text(value, where: str, field: str) -> str:
    """A non-empty JSON string."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: {field!r} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{where}: {field!r} is empty")
    return value


def check_answer(value, where: str, vocab_size: int):
    """An optional answer: ``None``, a string, or a list of token ids (returned as ``list[int]``)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return check_ids(value, where, "answer", vocab_size).tolist()
    raise ValueError(f"{where}: 'answer' must be a string or a list of token ids, "
                     f"got {type(value).__name__}")


def check_metadata(value, where: str) -> dict | None:
    """Optional free-form metadata: ``None`` or a JSON object."""
    if value is None or isinstance(value, dict):
        return value
    raise ValueError(f"{where}: 'metadata' must be a JSON object, got {type(value).__name__}")


def check_rewards(value, where: str, num_generations: int) -> torch.Tensor:
    """A list of ``num_generations`` finite numbers as a float32 ``rewards_G`` tensor."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: 'rewards' must be a list of numbers, got {type(value).__name__}")
    if len(value) != num_generations:
        raise ValueError(f"{where}: 'rewards' has {len(value)} entries, "
                         f"--num-generations is {num_generations}")
    for g, reward in enumerate(value):
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ValueError(f"{where}: reward {g} is {reward!r}; rewards must be numbers")
        if not math.isfinite(reward):
            raise ValueError(f"{where}: reward {g} is {reward}; rewards must be finite")
    return torch.tensor(value, dtype=torch.float32)


def check_logprobs(value, where: str, responses: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sampler's per-token log-probs, one list per response of its length, as float32 1-D
    tensors: finite numbers, none above 0 (beyond rounding, 1e-3)."""
    if not isinstance(value, list) or len(value) != len(responses):
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{where}: 'logprobs' must be a list of {len(responses)} lists (one per response), got {got}")
    out = []
    for g, (values, response_R) in enumerate(zip(value, responses)):
        if not isinstance(values, list):
            raise ValueError(f"{where}: 'logprobs[{g}]' must be a list of numbers, got {type(values).__name__}")
        if len(values) != response_R.numel():
            raise ValueError(f"{where}: 'logprobs[{g}]' has {len(values)} values, 'responses[{g}]' has "
                             f"{response_R.numel()} tokens")
        for t, x in enumerate(values):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x > 1e-3:
                raise ValueError(f"{where}: 'logprobs[{g}][{t}]' is {x!r}; a log-prob must be a finite number <= 0")
        out.append(torch.tensor(values, dtype=torch.float32))
    return out
