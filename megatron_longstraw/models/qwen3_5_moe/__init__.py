"""The Qwen3.5 / Qwen3.6 MoE family (HF ``qwen3_5_moe`` / ``qwen3_5_moe_text``): Qwen3.5's Gated
DeltaNet and gated attention (``models/qwen3_5/``) with Megatron's ``MoELayer`` in every layer
(``config.py``), its weights (``convert.py``), its cost (``profile.py``) and presets
(``presets.py``), registered as ``FAMILY``."""

from megatron_longstraw.models.family import ModelFamily
from megatron_longstraw.models.qwen3_5_moe import config, convert, presets, profile, spec
from megatron_longstraw.models.registry import register_family

FAMILY = register_family(ModelFamily.of_package(config=config, spec=spec, convert=convert, profile=profile,
                                                presets=presets))
