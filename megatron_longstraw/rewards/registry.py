"""Rewards by name: the built-ins, ones registered in code, and ``module:function``.

``build_reward(spec, ...)`` resolves ``--reward-fn``:

* a registered name (``exact_match``, ``synthetic_retrieval``, or one added with
  ``register_reward``): its factory is called with a ``RewardContext``;
* ``module:function`` (``function`` may be a dotted attribute path): imported from
  ``sys.path`` or the working directory (as under ``python -m``) and used as is; it must have
  the common per-sample signature ``function(prompt_ids, response_ids, answer, metadata) ->
  float``.

Unknown names, modules that cannot be imported and missing or non-callable attributes raise a
``ValueError`` naming ``--reward-fn``.
"""

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from megatron_longstraw.rewards.builtin import BUILTIN_REWARDS
from megatron_longstraw.rewards.context import RewardContext

REWARDS: dict[str, Callable[[RewardContext], Callable]] = dict(BUILTIN_REWARDS)


@dataclass(frozen=True)
class RewardFunction:
    """A per-sample reward with the name it was selected by (for error messages)."""

    name: str
    fn: Callable

    def __call__(self, prompt_ids, response_ids, answer, metadata):
        """``fn(prompt_ids, response_ids, answer, metadata)``."""
        return self.fn(prompt_ids, response_ids, answer, metadata)


def register_reward(name: str):
    """Decorator registering a reward factory ``factory(context) -> reward`` under ``name``."""
    def decorate(factory):
        if name in REWARDS:
            raise ValueError(f"a reward named {name!r} is already registered")
        if ":" in name:
            raise ValueError(f"reward name {name!r} must not contain ':'")
        REWARDS[name] = factory
        return factory
    return decorate


def load_user_reward(spec: str, flag: str = "--reward-fn") -> Callable:
    """The callable named by ``module:function``; the working directory is put first on
    ``sys.path`` when it is not there (``python -m`` does the same; ``python train_grpo.py`` puts
    the script's folder there instead)."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"{flag} {spec!r}: expected module:function")
    cwd = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ValueError(f"{flag} {spec!r}: no module named {module_name!r}") from err
        raise ValueError(f"{flag} {spec!r}: importing {module_name!r} failed: {err}") from err
    except Exception as err:
        raise ValueError(f"{flag} {spec!r}: importing {module_name!r} failed: "
                         f"{type(err).__name__}: {err}") from err
    obj = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{flag} {spec!r}: module {module_name!r} has no attribute "
                             f"{attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{flag} {spec!r}: {attr_path!r} is not callable")
    return obj


def build_reward(spec: str, *, eos_id: int | None = None, tokenizer=None,
                 partial_credit: float = 0.0, flag: str = "--reward-fn") -> RewardFunction:
    """The reward selected by ``spec`` (a registered name or ``module:function``)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{flag} must name a reward, got {spec!r}")
    if ":" in spec:
        return RewardFunction(spec, load_user_reward(spec, flag))
    if spec not in REWARDS:
        raise ValueError(f"{flag} {spec!r}: unknown reward; registered: {', '.join(sorted(REWARDS))} "
                         "(or give module:function)")
    context = RewardContext(eos_id=eos_id, tokenizer=tokenizer, partial_credit=partial_credit)
    return RewardFunction(spec, REWARDS[spec](context))
