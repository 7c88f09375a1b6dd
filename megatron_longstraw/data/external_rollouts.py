"""External rollouts: prompt groups sampled elsewhere (vLLM, SGLang, ...) for training here.

A JSONL file, one line per prompt group, each a JSON object with

* ``"prompt"`` (text) or ``"prompt_ids"`` (token ids), as in ``prompts.py``;
* ``"responses"``: exactly ``--num-generations`` responses, each a non-empty text or a
  non-empty list of token ids. A text response is tokenized without special tokens and, with
  ``append_eos`` (default), gets EOS appended unless it already ends with it (vLLM/SGLang
  return text without the stop token). An id list is used verbatim: include EOS yourself when
  the sampler stopped on it;
* optional ``"rewards"``: ``--num-generations`` finite numbers; when absent the reward function
  scores the responses (``RolloutGroup.score``);
* optional ``"logprobs"``: the sampler's log-prob of every response token, one list per response
  of its length (as vLLM and SGLang return them), for the rollout correction
  (``--rollout-correction``); only with token-id responses, the sampler's own tokens (a text is
  tokenized again here, and its tokens need not be the ones sampled);
* optional ``"answer"`` (text or token ids) and ``"metadata"`` (an object).

Every error (bad JSON, unknown or missing key, wrong type, wrong G, empty response, id outside
the vocabulary, non-finite reward, log-probs of the wrong length or not finite, too-long prompt
or response) is a ``ValueError`` starting
with ``<file>:<line>:``. Line offsets only are kept in memory; ``validate``, order and the
checkpointable position work as in ``prompts.PromptDataset``.
"""

from dataclasses import dataclass

import torch

from megatron_longstraw.data.jsonl import (check_answer, check_id_range, check_ids, check_logprobs,
                                           check_metadata, check_rewards, check_text)
from megatron_longstraw.data.prompts import JsonlDataset, parse_prompt
from megatron_longstraw.rewards.scoring import score_group

ROLLOUT_EXTRA_KEYS = ("responses", "rewards", "logprobs")


@dataclass
class RolloutGroup:
    """One prompt and its G responses (1-D LongTensors), with the given ``rewards_G`` or
    ``None``, the sampler's per-token log-probs (one float32 1-D tensor per response) or ``None``;
    ``source`` is ``<file>:<line>``."""

    prompt_ids_P: torch.Tensor
    responses: list[torch.Tensor]
    rewards_G: torch.Tensor | None
    answer: str | list[int] | None
    metadata: dict | None
    source: str
    sampler_logprobs: list[torch.Tensor] | None = None

    def score(self, reward_fn) -> torch.Tensor:
        """``rewards_G``: the file's rewards when it gave them, else ``reward_fn``'s."""
        if self.rewards_G is not None:
            return self.rewards_G
        return score_group(reward_fn, self.prompt_ids_P, self.responses, self.answer,
                           self.metadata, source=self.source)


class ExternalRolloutDataset(JsonlDataset):
    """Rollout groups from a JSONL file (see the module docstring); ``next(dataset)`` ->
    ``RolloutGroup``. ``tokenizer`` is needed for text prompts/responses; ``vocab_size``
    defaults to the tokenizer's; ``logprobs_for`` (a ``--rollout-correction`` mode) makes
    ``"logprobs"`` required in every record (so ``validate`` finds a record without them at once)."""

    def __init__(self, path: str, tokenizer=None, *, num_generations: int,
                 vocab_size: int | None = None, max_prompt_length: int | None = None,
                 max_response_length: int | None = None, append_eos: bool = True,
                 seed: int = 0, shuffle: bool = True, validate: bool = True,
                 flag: str = "--external-rollouts", logprobs_for: str | None = None):
        if num_generations < 1:
            raise ValueError(f"--num-generations must be >= 1, got {num_generations}")
        self.num_generations = num_generations
        self.max_response_length = max_response_length
        self.append_eos = append_eos
        self.logprobs_for = logprobs_for  # the --rollout-correction that needs every record's log-probs
        super().__init__(path, tokenizer, vocab_size=vocab_size, max_prompt_length=max_prompt_length,
                         seed=seed, shuffle=shuffle, validate=validate, flag=flag)

    def _response(self, value, where: str, g: int) -> torch.Tensor:
        field = f"responses[{g}]"
        if isinstance(value, list):
            response_R = check_ids(value, where, field, self.vocab_size)
        elif isinstance(value, str):
            text = check_text(value, where, field)
            if self.tokenizer is None:
                raise ValueError(f"{where}: {field!r} is text but no tokenizer was given "
                                 "(--tokenizer-type); use token ids or give a tokenizer")
            try:
                ids = self.tokenizer.tokenize(text, add_special_tokens=False)
            except ValueError as err:
                raise ValueError(f"{where}: cannot tokenize {field!r}: {err}") from err
            if self.append_eos and (not ids or ids[-1] != self.tokenizer.eos_id):
                ids = ids + [self.tokenizer.eos_id]
            if not ids:
                raise ValueError(f"{where}: {field!r} tokenizes to no tokens")
            response_R = check_id_range(torch.tensor(ids, dtype=torch.long), where, field,
                                        self.vocab_size)
        else:
            raise ValueError(f"{where}: {field!r} must be a text or a list of token ids, "
                             f"got {type(value).__name__}")
        if self.max_response_length is not None and response_R.numel() > self.max_response_length:
            raise ValueError(f"{where}: {field!r} has {response_R.numel()} tokens, more than "
                             f"--max-response-length {self.max_response_length}")
        return response_R

    def __getitem__(self, i: int) -> RolloutGroup:
        """Group ``i`` in file order."""
        obj = self.lines.read(i)
        where = self.lines.where(i)
        prompt_ids_P = parse_prompt(obj, where, self.tokenizer, self.vocab_size,
                                    self.max_prompt_length, extra_keys=ROLLOUT_EXTRA_KEYS)
        if "responses" not in obj:
            raise ValueError(f"{where}: missing 'responses'")
        responses = obj["responses"]
        if not isinstance(responses, list):
            raise ValueError(f"{where}: 'responses' must be a list, got {type(responses).__name__}")
        if len(responses) != self.num_generations:
            raise ValueError(f"{where}: 'responses' has {len(responses)} entries, "
                             f"--num-generations is {self.num_generations}")
        rewards = obj.get("rewards")
        parsed = [self._response(r, where, g) for g, r in enumerate(responses)]
        logprobs = obj.get("logprobs")
        if logprobs is None and self.logprobs_for:
            raise ValueError(f"{where}: --rollout-correction {self.logprobs_for} needs the sampler's 'logprobs' in "
                             "every record, and this one has none")
        if logprobs is not None and any(isinstance(r, str) for r in responses):
            raise ValueError(f"{where}: 'logprobs' needs token-id responses (the sampler's own tokens): a text "
                             "response is tokenized again here, and its tokens need not be the ones sampled")
        return RolloutGroup(
            prompt_ids_P=prompt_ids_P,
            responses=parsed,
            sampler_logprobs=None if logprobs is None else check_logprobs(logprobs, where, parsed),
            rewards_G=None if rewards is None else check_rewards(rewards, where,
                                                                 self.num_generations),
            answer=check_answer(obj.get("answer"), where, self.vocab_size),
            metadata=check_metadata(obj.get("metadata"), where),
            source=where)
