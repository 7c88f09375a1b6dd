"""JSONL prompt dataset.

Each non-blank line is a JSON object with exactly one of

* ``"prompt"``: text, tokenized with the tokenizer (``Tokenizer.tokenize``, special tokens
  included), or
* ``"prompt_ids"``: a list of token ids,

plus optional ``"answer"`` (text or a list of token ids) and optional ``"metadata"`` (an object,
handed to the reward function as is). Any other key, bad JSON, a wrong type, an empty prompt, an
id outside ``[0, vocab_size)`` or a prompt longer than the maximum prompt length raises a
``ValueError`` starting with ``<file>:<line>:``.

Only line offsets are kept in memory; a record is re-read (and re-tokenized) when it is handed
out. With ``validate=True`` (default) every line is checked once up front, so a bad line fails
at start-up rather than hours into a run; ``validate=False`` skips that pass (each line is
still checked when it is read).

Order: epoch ``e`` visits the lines in a permutation drawn from ``(seed, e)``; the position is
checkpointable (``state_dict()``/``load_state_dict()``, see ``position.py``).
"""

import torch

from megatron_longstraw.data.items import PromptItem
from megatron_longstraw.data.jsonl import (JsonlIndex, check_answer, check_id_range, check_ids,
                                           check_keys, check_metadata, check_text)
from megatron_longstraw.data.position import EpochOrder, PositionedDataset

PROMPT_KEYS = ("prompt", "prompt_ids", "answer", "metadata")


def resolve_max_prompt_length(max_prompt_length: int | None = None,
                              max_position_embeddings: int | None = None,
                              max_response_length: int | None = None) -> int | None:
    """The longest prompt allowed: ``--max-prompt-length`` when given (checked against the
    model's positions), else the model's positions minus ``--max-response-length``; ``None``
    when nothing bounds it."""
    if max_prompt_length is not None:
        if max_prompt_length < 1:
            raise ValueError(f"--max-prompt-length must be >= 1, got {max_prompt_length}")
        if (max_position_embeddings is not None and max_response_length is not None
                and max_prompt_length + max_response_length > max_position_embeddings):
            raise ValueError(f"--max-prompt-length {max_prompt_length} plus --max-response-length "
                             f"{max_response_length} exceeds the model's {max_position_embeddings} "
                             "positions")
        return max_prompt_length
    if max_position_embeddings is None:
        return None
    limit = max_position_embeddings - (max_response_length or 0)
    if limit < 1:
        raise ValueError(f"--max-response-length {max_response_length} leaves no room for a prompt "
                         f"in the model's {max_position_embeddings} positions")
    return limit


def parse_prompt(obj: dict, where: str, tokenizer, vocab_size: int,
                 max_prompt_length: int | None, extra_keys: tuple[str, ...] = ()) -> torch.Tensor:
    """``prompt_ids_P`` of a record holding ``"prompt"`` or ``"prompt_ids"``, validated."""
    check_keys(obj, where, PROMPT_KEYS + extra_keys)
    if ("prompt" in obj) == ("prompt_ids" in obj):
        state = "both" if "prompt" in obj else "neither"
        raise ValueError(f"{where}: a record needs exactly one of 'prompt' or 'prompt_ids', "
                         f"it has {state}")
    if "prompt_ids" in obj:
        prompt_ids_P = check_ids(obj["prompt_ids"], where, "prompt_ids", vocab_size)
    else:
        text = check_text(obj["prompt"], where, "prompt")
        if tokenizer is None:
            raise ValueError(f"{where}: 'prompt' is text but no tokenizer was given "
                             "(--tokenizer-type); use 'prompt_ids' or give a tokenizer")
        try:
            ids = tokenizer.tokenize(text)
        except ValueError as err:
            raise ValueError(f"{where}: cannot tokenize 'prompt': {err}") from err
        if not ids:
            raise ValueError(f"{where}: 'prompt' tokenizes to no tokens")
        prompt_ids_P = check_id_range(torch.tensor(ids, dtype=torch.long), where, "prompt",
                                      vocab_size)
    if max_prompt_length is not None and prompt_ids_P.numel() > max_prompt_length:
        raise ValueError(f"{where}: prompt has {prompt_ids_P.numel()} tokens, more than the maximum "
                         f"prompt length {max_prompt_length}")
    return prompt_ids_P


def resolve_vocab_size(vocab_size: int | None, tokenizer, flag: str) -> int:
    """``vocab_size`` when given, else the tokenizer's."""
    if vocab_size is None:
        if tokenizer is None:
            raise ValueError(f"{flag}: token ids cannot be checked without a tokenizer or a "
                             "vocabulary size")
        vocab_size = tokenizer.vocab_size
    if vocab_size < 1:
        raise ValueError(f"{flag}: vocabulary size must be >= 1, got {vocab_size}")
    return vocab_size


class JsonlDataset(PositionedDataset):
    """Base of the JSONL datasets: the line index, tokenizer, vocabulary size, prompt bound and
    position. ``validate`` reads every line once up front, so a bad line fails before training;
    subclasses set what their ``__getitem__`` needs before calling this ``__init__``."""

    def __init__(self, path: str, tokenizer, *, vocab_size: int | None, max_prompt_length: int | None,
                 seed: int, shuffle: bool, validate: bool, flag: str):
        self.lines = JsonlIndex(path, flag)
        self.path = self.lines.path
        self.tokenizer = tokenizer
        self.vocab_size = resolve_vocab_size(vocab_size, tokenizer, flag)
        self.max_prompt_length = max_prompt_length
        self.order = EpochOrder(len(self.lines), seed, shuffle)
        if validate:
            for i in range(len(self.lines)):
                self[i]

    def __len__(self) -> int:
        return len(self.lines)


class PromptDataset(JsonlDataset):
    """Prompts from a JSONL file (see the module docstring); ``next(dataset)`` -> ``PromptItem``.

    ``tokenizer`` (a ``tokenizer.Tokenizer``) is needed for text prompts; ``vocab_size``
    defaults to the tokenizer's (pass the model's when ids are given directly);
    ``max_prompt_length`` comes from ``resolve_max_prompt_length``; ``flag`` names the option
    that gave ``path`` in error messages.
    """

    def __init__(self, path: str, tokenizer=None, *, vocab_size: int | None = None,
                 max_prompt_length: int | None = None, seed: int = 0, shuffle: bool = True,
                 validate: bool = True, flag: str = "--prompt-data"):
        super().__init__(path, tokenizer, vocab_size=vocab_size, max_prompt_length=max_prompt_length,
                         seed=seed, shuffle=shuffle, validate=validate, flag=flag)

    def __getitem__(self, i: int) -> PromptItem:
        """Record ``i`` in file order."""
        obj = self.lines.read(i)
        where = self.lines.where(i)
        prompt_ids_P = parse_prompt(obj, where, self.tokenizer, self.vocab_size,
                                    self.max_prompt_length)
        return PromptItem(prompt_ids_P=prompt_ids_P,
                          answer=check_answer(obj.get("answer"), where, self.vocab_size),
                          metadata=check_metadata(obj.get("metadata"), where),
                          source=where)
