"""Scoring one prompt's group of G responses with a per-sample reward."""

import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np
import torch

from megatron_longstraw.rewards.builtin import as_id_list


def reward_name(fn: Callable) -> str:
    """The name used for ``fn`` in error messages."""
    return getattr(fn, "name", None) or getattr(fn, "__qualname__", None) or repr(fn)


def _as_float(value, name: str, g: int, at: str) -> float:
    """A reward result as a finite float; ``ValueError`` naming the function otherwise."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        count = value.numel() if isinstance(value, torch.Tensor) else np.size(value)
        if count != 1:
            raise ValueError(f"reward function {name!r} (--reward-fn) returned an array of shape "
                             f"{tuple(value.shape)} for sample {g}{at}; a reward must be a number")
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(f"reward function {name!r} (--reward-fn) returned "
                         f"{type(value).__name__} for sample {g}{at}; a reward must be a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward function {name!r} (--reward-fn) returned {value} for sample "
                         f"{g}{at}; a reward must be finite")
    return value


def _response(responses, g: int, lengths_G) -> torch.Tensor:
    response = responses[g]
    if not isinstance(response, torch.Tensor):
        response = torch.tensor(as_id_list(response), dtype=torch.long)
    response = response.reshape(-1)
    if lengths_G is not None:
        response = response[:int(lengths_G[g])]
    return response


def score_group(fn: Callable, prompt_ids, responses: Sequence | torch.Tensor, answer=None,
                metadata: dict | None = None, *, lengths_G=None, source: str | None = None
                ) -> torch.Tensor:
    """``rewards_G`` (float32): ``fn(prompt_ids, response_ids, answer, metadata)`` for each of the
    G responses.

    ``responses`` is a sequence of G id sequences (1-D tensors or lists), or a ``[G, T]``
    tensor cut to ``lengths_G``; each reaches ``fn`` as a 1-D LongTensor. A tensor ``answer``
    reaches ``fn`` as ``list[int]``. ``source`` (e.g. ``file:line``) is named in errors. A
    function that raises is re-raised as a ``ValueError`` naming it and the sample index (the
    original exception chained); a result that is not a finite number is a ``ValueError``
    naming the function.
    """
    name = reward_name(fn)
    at = f" of {source}" if source else ""
    if isinstance(answer, torch.Tensor):
        answer = answer.reshape(-1).tolist()
    num_generations = len(responses)
    if lengths_G is not None and len(lengths_G) != num_generations:
        raise ValueError(f"score_group: {len(lengths_G)} lengths for {num_generations} responses")
    rewards = []
    for g in range(num_generations):
        response_ids = _response(responses, g, lengths_G)
        try:
            value = fn(prompt_ids, response_ids, answer, metadata)
        except Exception as err:
            raise ValueError(f"reward function {name!r} (--reward-fn) raised on sample {g}{at}: "
                             f"{type(err).__name__}: {err}") from err
        rewards.append(_as_float(value, name, g, at))
    return torch.tensor(rewards, dtype=torch.float32)
