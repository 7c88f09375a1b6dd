"""What ``--model`` names: a preset of a registered family (``ModelFamily.presets``, each an
HF-style config dict), an HF folder or a ``config.json``; and a model cut to fewer layers.

A preset is exactly what a ``config.json`` would hold, so presets, HF folders and the
``transformers`` reference models all go through one path (``resolve_hf_config``). Every
family has a tiny ``*-debug`` size for CPU tests.
"""

import copy

from megatron_longstraw.models.hf_config import read_config_json
from megatron_longstraw.models.registry import all_presets


def preset_names() -> list[str]:
    """All preset names."""
    return sorted(all_presets())


def resolve_hf_config(model: str) -> dict:
    """A preset name, an HF folder, or a ``config.json`` path -> a fresh config dict."""
    presets = all_presets()
    if model in presets:
        config = copy.deepcopy(presets[model])
        config["_source"] = f"preset {model}"
        return config
    if "/" in model or model.endswith(".json"):
        return read_config_json(model)
    raise ValueError(
        f"--model {model!r} is neither a preset ({', '.join(preset_names())}) nor a path"
    )


# per-layer pattern fields of the HF configs (one entry per decoder layer)
_LAYER_LISTS = ("layer_types", "mlp_layer_types", "indexer_types")


def with_num_layers(hf: dict, num_layers: int) -> dict:
    """A copy of ``hf`` keeping its first ``num_layers`` decoder layers (per-layer patterns cut
    to match): the same widths at a reduced depth, for runs scaled to fewer GPUs."""
    total = hf["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ValueError(f"--num-layers must be in [1, {total}] for this model, got {num_layers}")
    config = copy.deepcopy(hf)
    config["num_hidden_layers"] = num_layers
    for field in _LAYER_LISTS:
        if field in config:
            config[field] = config[field][:num_layers]
    if "first_k_dense_replace" in config:
        config["first_k_dense_replace"] = min(config["first_k_dense_replace"], num_layers)
    return config
