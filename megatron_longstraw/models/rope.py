"""RoPE scaling: YaRN as transformers computes it, in Megatron's models.

A YaRN config (``rope_parameters`` / ``rope_scaling`` with ``rope_type: yarn``, ``factor``,
``original_max_position_embeddings``, optionally ``attention_factor``, ``beta_fast``,
``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate``) changes the inverse frequencies
(interpolated by ``factor`` below the correction range, extrapolated above it, a linear ramp
between) and puts a factor on cos and sin (``attention_factor``, by default
``0.1 ln(factor) + 1``); DeepSeek-style configs (``mscale_all_dim``) also scale the softmax by
``mscale(factor, mscale_all_dim)^2``. ``yarn_of`` reads the scalars as transformers'
``_compute_yarn_parameters`` does and ``yarn_inv_freq`` computes the frequencies.

Two ways in: ``scale_rope`` puts them into a built ``GPTModel`` whose attention takes RoPE from
``GPTModel.rotary_pos_emb`` (Qwen3.5: its ``inv_freq`` and each attention's
``_yarn_concentration_factor``, the factor Megatron's attention applies to cos and sin);
``mla_yarn_kwargs`` gives Megatron's MLA / DSA-indexer ``YarnRotaryEmbedding`` settings (GLM-5).
Every mode (capture, replay, decoding, the exact sweep) takes RoPE from those modules, so each
sees the positions of the full forward. ``with_yarn`` is ``--yarn-factor``: YaRN over a
checkpoint's native positions, as the Qwen model cards extend 262,144 positions to ~1M.
"""

import math
from dataclasses import dataclass

import torch

from megatron_longstraw.models.hf_config import rope_parameters

ROPE_TYPES = ("default", "yarn")


def check_rope_type(hf: dict, family: str, supported=ROPE_TYPES) -> str:
    """The config's ``rope_type``; ``ValueError`` naming the config and the field for one the
    family does not take."""
    rope_type = rope_parameters(hf).get("rope_type", "default")
    if rope_type not in supported:
        raise ValueError(f"{hf.get('_source', 'config')}: rope_parameters.rope_type {rope_type!r} is not supported "
                         f"for {family} ({', '.join(supported)})")
    return rope_type


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 mscale ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class Yarn:
    """A YaRN config's scalars, defaults filled as transformers fills them."""

    base: float
    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    """The factor on cos and sin."""
    beta_fast: float
    beta_slow: float
    truncate: bool
    mscale: float | None
    mscale_all_dim: float | None
    """DeepSeek-style softmax scaling: ``mscale(factor, mscale_all_dim)^2`` when set."""


def yarn_of(hf: dict) -> Yarn:
    """The YaRN scalars of a ``rope_type: yarn`` config; ``ValueError`` naming the config and
    field for a missing original maximum or a non-positive factor."""
    rope = rope_parameters(hf)
    where = hf.get("_source", "config")
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(f"{where}: rope_parameters.original_max_position_embeddings is required for YaRN")
    factor = rope.get("factor")
    if factor is None:  # (DeepSeek-V3's configs: the ratio of the two maxima)
        factor = hf["max_position_embeddings"] / original
    if not factor > 0:
        raise ValueError(f"{where}: rope_parameters.factor must be positive, got {factor}")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else get_mscale(factor))
    return Yarn(base=rope.get("rope_theta", 10_000.0), factor=float(factor),
                original_max_position_embeddings=int(original),
                attention_factor=float(attention_factor), beta_fast=rope.get("beta_fast") or 32,
                beta_slow=rope.get("beta_slow") or 1, truncate=rope.get("truncate", True),
                mscale=mscale, mscale_all_dim=mscale_all_dim)


def yarn_inv_freq(yarn: Yarn, dim: int) -> torch.Tensor:
    """YaRN's inverse frequencies (fp32) for ``dim`` rotary channels."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(yarn.base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = yarn.base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_parameters(hf: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_factor)`` of a YaRN config for the rotary part of ``head_dim``
    (``partial_rotary_factor``), as transformers' ``_compute_yarn_parameters`` returns them."""
    yarn = yarn_of(hf)
    dim = int(head_dim * rope_parameters(hf).get("partial_rotary_factor", 1.0))
    return yarn_inv_freq(yarn, dim), yarn.attention_factor


def scale_rope(model, hf: dict) -> None:
    """Put a YaRN config's frequencies and cos/sin factor into a built ``GPTModel`` (nothing for
    the default RoPE or a model without ``rotary_pos_emb``, e.g. MLA's, which
    ``mla_yarn_kwargs`` configures)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None or rope_parameters(hf).get("rope_type", "default") != "yarn":
        return
    inv_freq, attention_factor = yarn_parameters(hf, model.config.kv_channels)
    assert inv_freq.shape == rotary.inv_freq.shape, (tuple(inv_freq.shape), tuple(rotary.inv_freq.shape))
    rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)
    if hasattr(rotary.forward, "cache_clear"):  # Megatron caches the tables it made
        rotary.forward.cache_clear()
    for module in model.modules():
        if hasattr(module, "_yarn_concentration_factor"):
            module._yarn_concentration_factor = attention_factor


def mla_yarn_kwargs(hf: dict) -> dict:
    """Megatron ``MLATransformerConfig`` settings whose ``YarnRotaryEmbedding`` (MLA and the DSA
    indexer) and softmax scale equal transformers' YaRN for this config.

    Megatron's factor on cos/sin is ``mscale(f, mscale) / mscale(f, mscale_all_dim)`` and its
    softmax scale ``mscale(f, mscale_all_dim)^2 / sqrt(d)``; transformers' are
    ``attention_factor`` and, when ``mscale_all_dim`` is set, the same softmax scale. So
    ``mscale_all_dim`` passes through and ``mscale`` is solved for ``attention_factor``.
    ``ValueError`` naming the field for what Megatron cannot express (``truncate: false``, an
    ``attention_factor`` other than 1 with ``factor <= 1``)."""
    yarn, where = yarn_of(hf), hf.get("_source", "config")
    if not yarn.truncate:
        raise ValueError(f"{where}: rope_parameters.truncate=false is not supported with Megatron's MLA YaRN")
    mscale_all_dim = float(yarn.mscale_all_dim or 0.0)
    if yarn.factor <= 1:
        if yarn.attention_factor != 1.0:
            raise ValueError(f"{where}: rope_parameters.attention_factor {yarn.attention_factor} with factor "
                             f"{yarn.factor} <= 1 is not supported with Megatron's MLA YaRN")
        mscale = 1.0
    else:
        mscale = (yarn.attention_factor * get_mscale(yarn.factor, mscale_all_dim) - 1.0) / (
            0.1 * math.log(yarn.factor))
    return dict(rope_type="yarn", rotary_base=yarn.base, rotary_percent=1.0, rotary_scaling_factor=yarn.factor,
                original_max_position_embeddings=yarn.original_max_position_embeddings,
                beta_fast=float(yarn.beta_fast), beta_slow=float(yarn.beta_slow),
                mscale=mscale, mscale_all_dim=mscale_all_dim)


def with_yarn(hf: dict, factor: float, flag: str = "--yarn-factor") -> dict:
    """``hf`` with YaRN of ``factor`` over its native positions: ``rope_type: yarn``,
    ``original_max_position_embeddings`` = its ``max_position_embeddings``, which becomes
    ``factor`` times as many. A config that has YaRN of this factor is returned as is (a
    checkpoint saved by a run with the flag); one with another scaling is a ``ValueError``."""
    rope = rope_parameters(hf)
    where = hf.get("_source", "config")
    if rope.get("rope_type", "default") == "yarn":
        if float(rope.get("factor") or 0) == float(factor):
            return hf
        raise ValueError(f"{flag} {factor}: {where} already has YaRN with factor {rope.get('factor')}")
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{flag} {factor}: {where} has rope_type {rope['rope_type']!r}")
    if not factor > 1:
        raise ValueError(f"{flag} must be > 1, got {factor}")
    native = hf["max_position_embeddings"]
    scaled = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta", "partial_rotary_factor")}
    scaled["rope_parameters"] = dict(rope, rope_type="yarn", factor=float(factor),
                                     original_max_position_embeddings=native)
    scaled["max_position_embeddings"] = int(native * factor)
    return scaled
