"""Command lines generated from the typed configuration.

A configuration *group* is a frozen dataclass whose fields are flags; a *root* is a frozen
dataclass whose fields are groups (a command's whole configuration: ``TrainerConfig``,
``PlannerConfig``, ``BenchmarkConfig``). Every flag is defined once, by its field:

- the flag is the field's name with dashes (``tensor_model_parallel_size`` ->
  ``--tensor-model-parallel-size``);
- its help is the first paragraph of the field's docstring (the string right below it, as in
  Megatron's ``TransformerConfig``), ending with ``(default: X)`` unless it names its default
  itself or the default is unset (``None``) or off (``False``);
- its type and choices come from the annotation: ``int``, ``float``, ``str``, ``bool`` (a switch;
  ``--no-X`` as well when it defaults to on), ``Literal[...]`` (choices), ``Optional[...]``
  (default ``None``), ``tuple[int, ...]`` (comma-separated).

A root takes whole groups or some of their fields (``field(metadata={"flags": (...)})`` on the
root's group field); the others keep their defaults. ``parse`` builds the root from a command
line: each group from the flags given (the groups' ``__post_init__`` check them, ``ValueError``
naming the flag), then the root (whose ``__post_init__`` checks across groups). It also returns
which flags were given, for a command whose unset flags mean "search" (the planner's layout).

This module imports nothing of the package and no torch: ``--help`` answers at once.
"""

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
import sys
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin



@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One generated flag: where it is defined and what argparse gets for it."""

    flag: str
    """``--tensor-model-parallel-size``."""
    owner: type
    """The group class that defines it."""
    name: str
    """The field's name."""
    kwargs: dict
    """``add_argument`` keywords (type, choices, action, metavar, help)."""


@cache
def _module_field_docs(path: str) -> dict[str, dict[str, str]]:
    """Attribute docstrings of every class in the source file ``path``: ``{class: {field: doc}}``."""
    tree = ast.parse(Path(path).read_text())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            docs = {}
            for stmt, following in zip(node.body, node.body[1:]):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                        and isinstance(following.value.value, str)):
                    docs[stmt.target.id] = inspect.cleandoc(following.value.value)
            out[node.name] = docs
    return out


def field_docs(cls: type) -> dict[str, str]:
    """The docstring of every field of the dataclass ``cls`` (its bases' too), by field name."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            source = inspect.getsourcefile(klass)
            docs.update(_module_field_docs(source).get(klass.__name__, {}))
    return docs


def help_text(doc: str) -> str:
    """A field docstring's first paragraph on one line, without reST's double backquotes."""
    first = doc.split("\n\n")[0]
    return re.sub(r"\s+", " ", first.replace("``", "")).strip()


def flag_of(name: str) -> str:
    """The flag of field ``name``."""
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation):
    if get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _comma_list(item_type):
    def parse(text: str) -> tuple:
        try:
            return tuple(item_type(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                             f"{item_type.__name__}") from None
    parse.__name__ = f"comma-separated {item_type.__name__}"
    return parse


def _shown(value) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


@cache
def _late(reference: str):
    """``module:name`` imported now (a field's choices or help from another part of the package,
    named rather than imported, so that this layer imports nothing above it)."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def flag_spec(owner: type, f: dataclasses.Field) -> FlagSpec:
    """The flag of field ``f`` of the group ``owner`` (module doc); its owner is the class that
    defines the field (a subclass of a group takes its base's flags as they are)."""
    owner = next(c for c in owner.__mro__ if f.name in vars(c).get("__annotations__", {}))
    hints = typing.get_type_hints(owner)
    annotation = _unwrap_optional(hints[f.name])
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    doc = field_docs(owner).get(f.name)
    assert doc, f"{owner.__name__}.{f.name} has no docstring"
    text = help_text(doc)
    if "help_from" in f.metadata:  # e.g. the registered losses, named in --loss-type's help
        text = f"{text} {_late(f.metadata['help_from'])()}"
    kwargs: dict[str, Any] = {}
    if annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
    elif get_origin(annotation) is Literal:
        choices = get_args(annotation)
        kwargs.update(type=type(choices[0]), choices=list(choices))
    elif get_origin(annotation) is tuple:
        item = get_args(annotation)[0]
        kwargs.update(type=_comma_list(item), metavar=f"{item.__name__.upper()},...")
    else:
        kwargs["type"] = annotation
        kwargs["metavar"] = {int: "N", float: "X"}.get(annotation, f.name.upper())
    if "metavar" in f.metadata:
        kwargs["metavar"] = f.metadata["metavar"]
    if "default" not in text and default is not None and default is not False:
        text = f"{text[:-1]} (default: {_shown(default)})." if text.endswith(".") else f"{text} (default: {_shown(default)})"
    kwargs["help"] = text.replace("%", "%%")
    return FlagSpec(flag_of(f.name), owner, f.name, kwargs)


def group_fields(root: type) -> list[dataclasses.Field]:
    """The fields of a root that are groups (dataclasses)."""
    hints = typing.get_type_hints(root)
    return [f for f in dataclasses.fields(root) if dataclasses.is_dataclass(hints[f.name])]


def group_flag_specs(cls: type, only=None) -> list[FlagSpec]:
    """The flags of the group ``cls`` (``only`` those fields, when given), in field order."""
    fields = [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("flag", True)]
    if only is not None:
        unknown = set(only) - {f.name for f in fields}
        assert not unknown, f"{cls.__name__} has no flags {sorted(unknown)}"
        fields = [f for f in fields if f.name in only]
    return [flag_spec(cls, f) for f in fields]


def flag_specs(root: type) -> list[tuple[dataclasses.Field, list[FlagSpec]]]:
    """Per group field of ``root``: the flags it takes, in the group's field order."""
    hints = typing.get_type_hints(root)
    return [(group, group_flag_specs(hints[group.name], group.metadata.get("flags"))) for group in group_fields(root)]


def add_flags(parser: argparse.ArgumentParser, cls: type, only=None, about: str | None = None) -> None:
    """The flags of the group ``cls`` (``only`` those) added to a command's own ``parser`` as one
    argparse group, each with its field's default under the field's name: a tool with flags of its
    own takes the shared ones this way, and ``group_from`` builds the group from the values."""
    g = parser.add_argument_group(cls.TITLE, about)
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(cls)}
    for spec in group_flag_specs(cls, only):
        action = g.add_argument(spec.flag, dest=spec.name, default=defaults[spec.name], **spec.kwargs)
        action.flag_spec = spec


def group_from(namespace: argparse.Namespace, cls: type):
    """The group ``cls`` of the values ``add_flags`` left in ``namespace`` (checked on construction;
    fields the command does not take keep their defaults)."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{name: value for name, value in vars(namespace).items() if name in names})


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Metavars as the generated flags name them; descriptions kept as written."""


def build_parser(root: type, prog: str | None = None, description: str | None = None,
                 usage: str | None = None) -> argparse.ArgumentParser:
    """The command line of ``root``: one argparse group per group field (its class's ``TITLE``;
    the root may give a group its own description with ``metadata={"about": ...}``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, usage=usage,
                                     formatter_class=HelpFormatter, argument_default=argparse.SUPPRESS)
    hints = typing.get_type_hints(root)
    for group, specs in flag_specs(root):
        if not specs:
            continue
        cls = hints[group.name]
        g = parser.add_argument_group(cls.TITLE, group.metadata.get("about"))
        for spec in specs:
            action = g.add_argument(spec.flag, dest=f"{group.name}.{spec.name}", **spec.kwargs)
            action.flag_spec = spec  # where it was defined (tests/test_config.py)
    return parser


def config_from(root: type, values: dict[str, Any], **extra):
    """The root ``root`` from flag values ``{"group.field": value}`` (the others: defaults) and
    ``extra`` root fields that are not groups."""
    hints = typing.get_type_hints(root)
    groups = {}
    for group in group_fields(root):
        prefix = group.name + "."
        given = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
        groups[group.name] = hints[group.name](**given)
    return root(**groups, **extra)


def parse(root: type, argv=None, parser: argparse.ArgumentParser | None = None, **extra):
    """``(config, given)``: the root built from ``argv`` (``sys.argv[1:]`` when ``None``) and the
    ``"group.field"`` names of the flags the command line gave. ``ValueError`` (naming the flag)
    for a value the configuration refuses; argparse itself exits for an unknown flag or a value
    of the wrong type."""
    parser = parser or build_parser(root)
    values = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    return config_from(root, values, **extra), frozenset(values)


def as_dict(config) -> dict[str, dict[str, Any]]:
    """``{group: {field: value}}`` of a root (for logging a run's configuration)."""
    return {group.name: dataclasses.asdict(getattr(config, group.name)) for group in group_fields(type(config))}
