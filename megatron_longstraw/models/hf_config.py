"""Reading Hugging Face ``config.json`` files and presets into plain dicts, with clear errors."""

import json
from pathlib import Path
from typing import Any, Iterable


def read_config_json(path: str | Path) -> dict:
    """Load ``config.json`` (or the one inside a folder); errors name the file and line."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such config file")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{path}: missing field 'model_type'")
    config["_source"] = str(path)
    return config


def require(hf: dict, fields: Iterable[str], family: str) -> None:
    """Raise ``ValueError`` naming the first missing field and where the config came from."""
    for field in fields:
        if hf.get(field) is None:
            source = hf.get("_source", "config")
            raise ValueError(f"{source}: missing field {field!r} required by {family}")


def get(hf: dict, field: str, default: Any) -> Any:
    """``hf[field]`` unless absent or null."""
    value = hf.get(field)
    return default if value is None else value


def rope_parameters(hf: dict) -> dict:
    """The rope settings in transformers-5 form (``rope_parameters``), from either layout."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "rope_theta" not in params and "rope_theta" in hf:
        params["rope_theta"] = hf["rope_theta"]
    if "partial_rotary_factor" not in params and "partial_rotary_factor" in hf:
        params["partial_rotary_factor"] = hf["partial_rotary_factor"]
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


# HF config fields that do not change the model's weights or function (bookkeeping, generation
# and training settings, the position budget, which a run may raise: --max-position-embeddings)
NOT_ARCHITECTURE = frozenset({
    "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "initializer_range",
    "max_position_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout", "output_router_logits",
    "router_aux_loss_coef", "output_attentions", "output_hidden_states", "return_dict", "auto_map",
})
_ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")


def architecture_fields(hf: dict) -> dict:
    """The fields of a (normalized) config that describe the model: every field but bookkeeping
    (``NOT_ARCHITECTURE``, ``_``-prefixed), the rope settings flattened from either layout
    (``rope_theta``, ``partial_rotary_factor``, ``rope_type``, other ones as ``rope_parameters.X``)."""
    fields = {k: v for k, v in hf.items()
              if not k.startswith("_") and k not in NOT_ARCHITECTURE and k not in _ROPE_FIELDS}
    for key, value in rope_parameters(hf).items():
        fields[key if key.startswith("rope_") or key == "partial_rotary_factor" else f"rope_parameters.{key}"] = value
    return fields


def architecture_differences(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    """``[(field, value in a, value in b)]`` for every architecture field (``architecture_fields``)
    that both configs set, to different values; only ``model_type`` when that differs (the other
    fields of two families do not compare)."""
    if a.get("model_type") != b.get("model_type"):
        return [("model_type", a.get("model_type"), b.get("model_type"))]
    fa, fb = architecture_fields(a), architecture_fields(b)
    return [(k, fa[k], fb[k]) for k in fa if k in fb and fa[k] != fb[k]]
