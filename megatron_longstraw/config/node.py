"""The base of every node of the configuration tree (a group of flags, or a command's root of groups):
its choices checked on construction, then its own checks."""

import dataclasses
import types
import typing
from typing import ClassVar, Literal, get_args, get_origin


def _choices(annotation):
    """The choices of a ``Literal`` annotation (``Optional`` ones: with ``None``), else ``None``."""
    if get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        if len(inner) == 1 and get_origin(inner[0]) is Literal:
            return (None, *get_args(inner[0]))
        return None
    return get_args(annotation) if get_origin(annotation) is Literal else None


class ConfigNode:
    """Mixin of a node (a frozen dataclass, ``config/cli.py``): on construction every ``Literal``
    field is checked against its choices (``ValueError`` naming the flag, so objects built in code
    are held to what the command line allows), then ``check``."""

    TITLE: ClassVar[str] = ""
    """A group's title in ``--help``."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            allowed = _choices(hints[f.name])
            value = getattr(self, f.name)
            if allowed is not None and value not in allowed:
                shown = ", ".join(str(a) for a in allowed if a is not None)
                raise ValueError(f"--{f.name.replace('_', '-')} must be one of {shown}, got {value!r}")
        self.check()

    def check(self) -> None:
        """The node's own checks (``ValueError`` naming the flag); none by default."""
