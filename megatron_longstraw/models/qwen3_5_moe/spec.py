"""Qwen3.5-MoE's layer specs: Qwen3.5's (``models/qwen3_5/spec.py``), whose MLP is Megatron's
``MoELayer`` when the config has experts."""

from megatron_longstraw.models.qwen3_5.spec import block_spec

__all__ = ["block_spec"]
