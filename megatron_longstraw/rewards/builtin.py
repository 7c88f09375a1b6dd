"""Built-in rewards, each an exact, verifiable function of the token ids.

Every built-in is a factory ``factory(context: RewardContext) -> reward`` where ``reward`` has
the common per-sample signature ``reward(prompt_ids, response_ids, answer, metadata) -> float``
(``prompt_ids``/``response_ids``: 1-D LongTensors; ``answer``: text, ``list[int]`` or ``None``;
``metadata``: the record's dict or ``None``).

* ``exact_match``: the response cut at its first EOS (a response without EOS is taken whole)
  equals the answer cut at its first EOS -> 1.0, else 0.0. A text answer is compared with the
  cut response's text (special tokens skipped, surrounding whitespace stripped), which needs
  the tokenizer.
* ``synthetic_retrieval`` (for ``data/synthetic.py``; the answer is the value ids followed by
  EOS): 1.0 when the response starts with exactly the value followed by EOS. Otherwise 0.0,
  or, with ``partial_credit`` ``c`` in ``[0, 1)``, ``c * p / value_length`` where ``p`` is the
  length of the longest common prefix of the response and the value: partial credit for a
  correct prefix, always below the 1.0 of an exact answer.
"""

from collections.abc import Callable

import torch

from megatron_longstraw.rewards.context import RewardContext


def as_id_list(ids) -> list[int]:
    """Token ids (tensor, list or tuple) as ``list[int]``."""
    if isinstance(ids, torch.Tensor):
        return ids.reshape(-1).tolist()
    return [int(i) for i in ids]


def cut_at_eos(ids: list[int], eos_id: int) -> list[int]:
    """``ids`` up to (not including) the first ``eos_id``; all of them when there is none."""
    try:
        return ids[:ids.index(eos_id)]
    except ValueError:
        return ids


def exact_match(context: RewardContext) -> Callable:
    """Factory of the ``exact_match`` reward (see the module docstring)."""
    if context.eos_id is None:
        raise ValueError("--reward-fn exact_match needs the EOS id (from the tokenizer or the "
                         "synthetic task)")
    eos_id, tokenizer = context.eos_id, context.tokenizer

    def reward(prompt_ids, response_ids, answer, metadata) -> float:
        if answer is None:
            raise ValueError("exact_match needs an answer, the record has none")
        response = cut_at_eos(as_id_list(response_ids), eos_id)
        if isinstance(answer, str):
            if tokenizer is None:
                raise ValueError("exact_match against a text answer needs a tokenizer "
                                 "(--tokenizer-type)")
            text = tokenizer.detokenize(response, skip_special_tokens=True)
            return float(text.strip() == answer.strip())
        return float(response == cut_at_eos(as_id_list(answer), eos_id))

    return reward


def synthetic_retrieval(context: RewardContext) -> Callable:
    """Factory of the ``synthetic_retrieval`` reward (see the module docstring)."""
    partial_credit = float(context.partial_credit)
    if not 0.0 <= partial_credit < 1.0:
        raise ValueError(f"--reward-partial-credit must be in [0, 1), got {context.partial_credit}")

    def reward(prompt_ids, response_ids, answer, metadata) -> float:
        if answer is None or isinstance(answer, str):
            raise ValueError("synthetic_retrieval needs the answer ids (value + EOS)")
        answer = as_id_list(answer)
        if len(answer) < 2:
            raise ValueError(f"synthetic_retrieval: the answer must be value ids + EOS, got {answer}")
        response = as_id_list(response_ids)
        if response[:len(answer)] == answer:
            return 1.0
        if partial_credit == 0.0:
            return 0.0
        value = answer[:-1]
        matched = 0
        for got, want in zip(response, value):
            if got != want:
                break
            matched += 1
        return partial_credit * matched / len(value)

    return reward


BUILTIN_REWARDS: dict[str, Callable[[RewardContext], Callable]] = {
    "exact_match": exact_match,
    "synthetic_retrieval": synthetic_retrieval,
}
