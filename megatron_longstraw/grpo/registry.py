"""The policy losses by name, selected with ``--loss-type`` (after verl's ``register_policy_loss``).

A loss is a ``grpo/loss_base.py`` ``PolicyLoss`` subclass, one file each in ``grpo/losses/``,
registered where it is defined: ``@register_policy_loss("name")`` on the class. Every module of
``grpo/losses/`` is imported when a loss is first looked up, so a new file there is all a new
loss needs. ``--loss-type module:Class`` takes a loss from outside the package (a ``PolicyLoss``
subclass; imported from ``sys.path`` or the working directory), as ``--reward-fn`` and
``--model-family`` do.

This module imports no torch: ``loss_help`` reads the registered names and summaries from the
loss files' source (``--help`` answers at once); the classes load on first lookup.
"""

import ast
import importlib
import pkgutil
import sys
from functools import cache
from pathlib import Path

LOSS_PACKAGE = "megatron_longstraw.grpo.losses"
_LOSS_FOLDER = Path(__file__).resolve().parent / "losses"

POLICY_LOSSES: dict[str, type] = {}
"""Registered loss classes by name."""


def register_policy_loss(name: str):
    """Class decorator registering a ``PolicyLoss`` subclass under ``name`` (its ``name`` too)."""
    from megatron_longstraw.grpo.loss_base import PolicyLoss  # the loss module imported it already

    def register(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, PolicyLoss)):
            raise TypeError(f"policy loss {name!r} must be a PolicyLoss subclass, got {cls!r}")
        if POLICY_LOSSES.get(name, cls) is not cls:
            raise ValueError(f"policy loss {name!r} is already registered ({POLICY_LOSSES[name].__name__})")
        cls.name = name
        POLICY_LOSSES[name] = cls
        return cls
    return register


@cache
def _load_builtin_losses() -> None:
    """Import every module of ``grpo/losses/`` (their decorators register them)."""
    package = importlib.import_module(LOSS_PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{LOSS_PACKAGE}.{module.name}")


def _load_external(spec: str) -> type:
    """The ``PolicyLoss`` subclass ``module:Class`` (the working directory on ``sys.path``);
    ``ValueError`` naming ``--loss-type`` when it cannot be imported or is not a loss."""
    from megatron_longstraw.grpo.loss_base import PolicyLoss

    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"--loss-type {spec!r}: give a registered name or module:Class")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--loss-type {spec}: cannot import {module_name} ({err})") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, PolicyLoss)):
        raise ValueError(f"--loss-type {spec}: {module_name}.{class_name} is not a PolicyLoss subclass "
                         "(megatron_longstraw/grpo/loss_base.py)")
    if POLICY_LOSSES.get(cls.name) is not cls:  # not registered under a name of its own
        cls.name = spec
    return cls


def get_policy_loss(name: str) -> type:
    """The loss class registered under ``name``, or ``module:Class``; ``ValueError`` naming
    ``--loss-type`` otherwise."""
    if ":" in name:
        return _load_external(name)
    _load_builtin_losses()
    if name not in POLICY_LOSSES:
        raise ValueError(f"--loss-type must be one of {', '.join(sorted(POLICY_LOSSES))} or module:Class, "
                         f"got {name!r}")
    return POLICY_LOSSES[name]


def _registrations(path: Path) -> list[tuple[str, str]]:
    """``(name, summary)`` of each ``@register_policy_loss("name")`` class in the source ``path``
    (its ``summary`` class attribute)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        for decorator in node.decorator_list:
            if (isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "register_policy_loss"
                    and decorator.args and isinstance(decorator.args[0], ast.Constant)):
                summary = next((stmt.value.value for stmt in node.body if isinstance(stmt, (ast.Assign, ast.AnnAssign))
                                and "summary" in [getattr(t, "id", None) for t in
                                                  (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])]
                                and isinstance(stmt.value, ast.Constant)), "")
                out.append((decorator.args[0].value, summary))
    return out


def loss_help() -> str:
    """The registered losses for ``--loss-type``'s help, read from ``grpo/losses/`` without
    importing it: ``"grpo (clipped surrogate), ..."``."""
    entries = [entry for path in sorted(_LOSS_FOLDER.glob("*.py")) for entry in _registrations(path)]
    return "Registered: " + ", ".join(f"{name} ({summary})" if summary else name for name, summary in entries) + "."
