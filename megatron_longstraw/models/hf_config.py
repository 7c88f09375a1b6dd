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
