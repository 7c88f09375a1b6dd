"""Model families keyed by the exact Hugging Face ``model_type``.

A family module exposes ``MODEL_TYPES`` and the functions listed in ``FAMILY_API``; see
``qwen3_5.py`` for the reference layout. Families register here by module path so that
importing the registry stays cheap and a family is imported only when used.
"""

import importlib
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
    "hf_group",             # (HF checkpoint tensor name, hf) -> group id (convert together) or None
    "hf_to_mcore",          # (hf state dict, hf, partial=) -> full (unsharded) Megatron state dict
    "mcore_to_hf",          # (full Megatron state dict, hf, checkpoint_layout=) -> HF state dict
    "tp_sections",          # (param name, TransformerConfig) -> section sizes or None
)


def supported_model_types() -> list[str]:
    """Every HF ``model_type`` that has a family."""
    return sorted(FAMILY_MODULES)


def family_for(model_type: str) -> ModuleType:
    """The family module for an exact HF ``model_type``; ``ValueError`` if there is none."""
    if model_type not in FAMILY_MODULES:
        raise ValueError(
            f"unknown model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    module = importlib.import_module(FAMILY_MODULES[model_type])
    missing = [name for name in FAMILY_API if not hasattr(module, name)]
    assert not missing, f"family {module.__name__} lacks {missing}"
    assert model_type in module.MODEL_TYPES
    return module
