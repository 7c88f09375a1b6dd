"""The Qwen3.5 / Qwen3.6 hybrid family (HF ``qwen3_5`` / ``qwen3_5_text``): Gated DeltaNet and
gated full attention (``config.py``, ``spec.py``), its weights (``convert.py``), its cost
(``profile.py``) and presets (``presets.py``), registered as ``FAMILY``."""

from megatron_longstraw.models.family import ModelFamily
from megatron_longstraw.models.qwen3_5 import config, convert, presets, profile, spec
from megatron_longstraw.models.registry import register_family

FAMILY = register_family(ModelFamily.of_package(config=config, spec=spec, convert=convert, profile=profile,
                                                presets=presets))
