"""Model families keyed by the exact Hugging Face ``model_type``.

A family module exposes ``MODEL_TYPES`` and the functions listed in ``FAMILY_API``; see
``qwen3_5.py`` for the reference layout. Families register here by module path so that
importing the registry stays cheap and a family is imported only when used. A family outside
the package registers with ``register_family`` (a dotted module path or a ``.py`` file), which
checks it against ``FAMILY_API``.
"""

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FAMILY_MODULES = {
    "qwen3_5": "megatron_longstraw.models.qwen3_5",
    "qwen3_5_text": "megatron_longstraw.models.qwen3_5",
    "glm_moe_dsa": "megatron_longstraw.models.glm5",
}

FAMILY_API = (
    "MODEL_TYPES",          # exact HF model_type strings this family serves
    "normalize_hf_config",  # HF config dict -> flat text-model config dict (validated)
    "transformer_config",   # (hf, ModelOptions) -> TransformerConfig
    "block_spec",           # (TransformerConfig, backend) -> TransformerBlockSubmodules
    "gpt_model_kwargs",     # hf -> GPTModel kwargs (vocab, rope, tying)
    "check_layout",         # (hf, ParallelSizes, rollout source) -> None; ValueError naming the flag
    "hf_group",             # (HF checkpoint tensor name, hf) -> group id (convert together) or None
    "hf_to_mcore",          # (hf state dict, hf, partial=) -> full (unsharded) Megatron state dict
    "mcore_to_hf",          # (full Megatron state dict, hf, checkpoint_layout=) -> HF state dict
    "tp_sections",          # (param name, TransformerConfig) -> section sizes or None
    "prompt_flops",         # (normalized hf, model, prompt length) -> capture forward FLOPs or None
    "response_forward_flops",  # (normalized hf, model, prompt length, response tokens) -> FLOPs or None
    "hf_output_config",     # hf -> the config.json dict written next to converted HF weights
    "hf_reference",         # model_type -> (modeling module, model class, configuration module,
                            #   config class) of the transformers reference model, or None
)

OPTIONAL_API = (
    "plan_profile",         # hf -> models/profile.py ModelProfile (the budget planner's view); a family
                            #   without it is not planned (tools/plan_budget.py refuses, the trainer skips)
)

_REGISTERED: dict[str, ModuleType] = {}  # model_type -> out-of-tree family (register_family)


def supported_model_types() -> list[str]:
    """Every HF ``model_type`` that has a family (built in or registered)."""
    return sorted({*FAMILY_MODULES, *_REGISTERED})


def family_for(model_type: str) -> ModuleType:
    """The family module for an exact HF ``model_type``; ``ValueError`` if there is none."""
    if model_type in _REGISTERED:
        return _REGISTERED[model_type]
    if model_type not in FAMILY_MODULES:
        raise ValueError(
            f"unknown model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    module = importlib.import_module(FAMILY_MODULES[model_type])
    missing = [name for name in FAMILY_API if not hasattr(module, name)]
    assert not missing, f"family {module.__name__} lacks {missing}"
    assert model_type in module.MODEL_TYPES
    return module


def _is_file_spec(spec: str) -> bool:
    """A ``.py`` file path (else a dotted module path)."""
    return spec.endswith(".py") or "/" in spec


def _load_file(path: Path) -> ModuleType:
    """Import a family from a ``.py`` file once (as a private module name keyed by its path)."""
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


def load_family(spec: str) -> ModuleType:
    """Import a family from ``spec``, a dotted module path (importable) or a path to a ``.py``
    file, and check it against ``FAMILY_API``; ``ValueError`` (one line, naming ``spec``) when it
    cannot be imported, does not exist or lacks API entries."""
    kind = "file" if _is_file_spec(spec) else "module"
    if kind == "file" and not Path(spec).is_file():
        raise ValueError(f"model family file {spec}: no such file")
    try:
        module = _load_file(Path(spec)) if kind == "file" else importlib.import_module(spec)
    except ImportError as err:
        raise ValueError(f"model family {kind} {spec}: cannot be imported ({err})") from None
    missing = [name for name in FAMILY_API if not hasattr(module, name)]
    if missing:
        raise ValueError(f"model family {spec}: lacks {', '.join(missing)} "
                         "(the functions of FAMILY_API in megatron_longstraw/models/registry.py)")
    types = module.MODEL_TYPES
    if isinstance(types, str) or not types or not all(isinstance(t, str) for t in types):
        raise ValueError(f"model family {spec}: MODEL_TYPES must be a non-empty tuple of HF model_type strings")
    return module


def register_family(spec: str) -> ModuleType:
    """Load the family at ``spec`` (``load_family``) and serve its ``MODEL_TYPES`` from it;
    ``ValueError`` if one of them already has another family. Registering a family again (or a
    built-in one) is a no-op."""
    module = load_family(spec)
    new = [t for t in module.MODEL_TYPES if FAMILY_MODULES.get(t) != module.__name__]
    for model_type in new:
        owner = FAMILY_MODULES.get(model_type) or getattr(_REGISTERED.get(model_type), "__name__", None)
        if owner is not None and _REGISTERED.get(model_type) is not module:
            raise ValueError(f"model family {spec}: model_type {model_type!r} already has the family {owner}")
    for model_type in new:
        _REGISTERED[model_type] = module
    return module


def unregister_family(module: ModuleType) -> None:
    """Stop serving the model types of a family registered with ``register_family``."""
    for model_type in [t for t, m in _REGISTERED.items() if m is module]:
        del _REGISTERED[model_type]
