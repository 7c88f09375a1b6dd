"""Model families keyed by the exact Hugging Face ``model_type``.

A family is a ``models/family.py`` ``ModelFamily``, registered where it is defined: a package of
``models/`` (``models/qwen3_5/``, ``models/glm5/``) calls ``register_family`` on its ``FAMILY``.
The built-in packages are imported when a family is first looked up, so a new package there is
all a new family needs. A family outside the package is named by a dotted module path or a
``.py`` file, optionally ``:ATTRIBUTE`` (default ``FAMILY``), and registered with ``use_family``
(``--model-family``), as ``--loss-type`` and ``--reward-fn`` take theirs.
"""

import hashlib
import importlib
import importlib.util
import pkgutil
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from megatron_longstraw.models.family import ModelFamily

FAMILY_ATTRIBUTE = "FAMILY"
_MODELS = "megatron_longstraw.models"
_FAMILIES: dict[str, ModelFamily] = {}  # model_type -> family
_BUILTIN: set[str] = set()  # model types the package's own families serve


def register_family(family: ModelFamily) -> ModelFamily:
    """Serve ``family``'s model types from it; ``ValueError`` if one of them already has
    another family. Registering a family again is a no-op. Returns ``family``."""
    for model_type in family.model_types:
        owner = _FAMILIES.get(model_type)
        if owner is not None and owner is not family:
            raise ValueError(f"model family {family.name}: model_type {model_type!r} already has the family "
                             f"{owner.name}")
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


@cache
def _load_builtin() -> None:
    """Import every family package of ``models/`` (each registers its ``FAMILY``)."""
    package = importlib.import_module(_MODELS)
    for module in pkgutil.iter_modules(package.__path__):
        if module.ispkg:
            importlib.import_module(f"{_MODELS}.{module.name}")
    _BUILTIN.update(_FAMILIES)


def supported_model_types() -> list[str]:
    """Every HF ``model_type`` that has a family (built in or registered)."""
    _load_builtin()
    return sorted(_FAMILIES)


def builtin_model_types() -> list[str]:
    """The model types the package's own families serve."""
    _load_builtin()
    return sorted(_BUILTIN)


def family_for(model_type: str) -> ModelFamily:
    """The family of an exact HF ``model_type``; ``ValueError`` if there is none."""
    _load_builtin()
    if model_type not in _FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {', '.join(supported_model_types())}")
    return _FAMILIES[model_type]


def all_presets() -> dict[str, dict]:
    """Every registered family's presets by name."""
    _load_builtin()
    return {name: config for family in {id(f): f for f in _FAMILIES.values()}.values()
            for name, config in family.presets.items()}


def _is_file_spec(path: str) -> bool:
    """A ``.py`` file path (else a dotted module path)."""
    return path.endswith(".py") or "/" in path


def _load_file(path: Path) -> ModuleType:
    """Import a module from a ``.py`` file once (as a private module name keyed by its path)."""
    resolved = path.resolve()
    name = f"_longstraw_family_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ValueError(f"model family file {path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_family(spec: str) -> ModelFamily:
    """The ``ModelFamily`` that ``spec`` names: a dotted module path (importable) or a ``.py``
    file, with ``:ATTRIBUTE`` (default ``FAMILY``); ``ValueError`` (one line, naming ``spec``)
    when it cannot be imported, does not exist or is not a family. Registers nothing."""
    path, _, attribute = spec.rpartition(":") if spec.count(":") and not spec.endswith(".py") else (spec, "", "")
    attribute = attribute or FAMILY_ATTRIBUTE
    kind = "file" if _is_file_spec(path) else "module"
    if kind == "file" and not Path(path).is_file():
        raise ValueError(f"model family file {path}: no such file")
    try:
        module = _load_file(Path(path)) if kind == "file" else importlib.import_module(path)
    except (ImportError, TypeError, ValueError) as err:  # a ModelFamily lacking fields: a TypeError
        raise ValueError(f"model family {kind} {path}: cannot be imported ({err})") from None
    family = getattr(module, attribute, None)
    if not isinstance(family, ModelFamily):
        raise ValueError(f"model family {spec}: {attribute} must be a ModelFamily "
                         "(megatron_longstraw/models/family.py), got "
                         f"{'nothing' if family is None else type(family).__name__}")
    return family


def use_family(spec: str) -> ModelFamily:
    """Load the family at ``spec`` (``load_family``) and serve its model types from it
    (``register_family``); the built-in families keep theirs."""
    _load_builtin()
    return register_family(load_family(spec))


def unregister_family(family: ModelFamily) -> None:
    """Stop serving the model types of a family registered with ``use_family`` (a built-in
    family keeps its own)."""
    for model_type in [t for t, f in _FAMILIES.items() if f is family and t not in _BUILTIN]:
        del _FAMILIES[model_type]
