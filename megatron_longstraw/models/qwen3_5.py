"""Qwen3.5 / Qwen3.6 hybrid family (HF ``qwen3_5`` / ``qwen3_5_text``), text model.

Layers follow HF ``layer_types``: ``linear_attention`` layers are Megatron's ``GatedDeltaNet``
(fused in_proj ``[q, k, v, z, beta, alpha]``, causal conv over ``[q, k, v]``, gated RMSNorm,
L2-normed q/k), ``full_attention`` layers are Megatron's ``SelfAttention`` with the output gate,
per-head zero-centred q/k RMSNorm and partial RoPE (0.25), core attention from this project.
Every layer has a SwiGLU MLP; all RMSNorms are zero-centred ("1 + w") except Gated DeltaNet's
output norm, which is plain ``w`` in HF and stays plain here, so weights map one to one.

Weight layout differences handled by ``hf_to_mcore`` / ``mcore_to_hf``:
- attention ``q_proj`` rows are per head ``[q_h, gate_h]``; Megatron's ``linear_qkv`` rows are per
  KV group ``[q heads of g, gate heads of g, k_g, v_g]``;
- GDN ``in_proj_qkv|z|b|a`` concatenate into ``in_proj`` (TP splits each section, ``tp_sections``);
- MLP ``gate_proj``/``up_proj`` concatenate into ``linear_fc1``.
"""

import re
from functools import partial

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_longstraw.attention.sdpa_core import SDPACoreAttention
from megatron_longstraw.models.flops import (DELTA_RULE_CHUNK, causal_attention_flops, delta_rule_flops,
                                          linear_flops, linear_weight_elements, logits_flops)
from megatron_longstraw.models.gated_delta_net import LongStrawGatedDeltaNet
from megatron_longstraw.models.hf_config import get, require, rope_parameters
from megatron_longstraw.models.norms import PlainTENorm, RMSNorm
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.pipeline_stage import local_layer_ids
from megatron_longstraw.models.profile import (LayerProfile, ModelProfile, profile_name, replay_output_bytes,
                                            rms_norm_saved_bytes, swiglu_mlp_saved_bytes)

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
FAMILY = "Qwen3.5"

_REQUIRED = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "layer_types",
)
_LAYER_TYPES = ("linear_attention", "full_attention")


def normalize_hf_config(hf: dict) -> dict:
    """Flatten a ``qwen3_5`` (multimodal) config to its ``text_config`` and validate it."""
    if hf.get("model_type") == "qwen3_5":
        if "text_config" not in hf:
            raise ValueError(f"{hf.get('_source', 'config')}: missing field 'text_config'")
        text = dict(hf["text_config"])
        text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
        text["model_type"] = "qwen3_5_text"
        text["_source"] = hf.get("_source", "config")
        hf = text
    hf = dict(hf)
    if hf.get("layer_types") is None and hf.get("num_hidden_layers"):
        interval = get(hf, "full_attention_interval", 4)
        hf["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(hf["num_hidden_layers"])
        ]
    require(hf, _REQUIRED, FAMILY)
    bad = [t for t in hf["layer_types"] if t not in _LAYER_TYPES]
    if bad or len(hf["layer_types"]) != hf["num_hidden_layers"]:
        raise ValueError(
            f"{hf.get('_source', 'config')}: layer_types must list {hf['num_hidden_layers']} "
            f"entries from {_LAYER_TYPES}, got {len(hf['layer_types'])} (bad: {bad[:3]})"
        )
    return hf


def _check_divisible(value: int, what: str, tp: int) -> None:
    if value % tp:
        raise ValueError(f"{what} ({value}) is not divisible by --tensor-model-parallel-size {tp}")


def transformer_config(hf: dict, options: ModelOptions) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for a normalized Qwen3.5 config."""
    kwargs = options.config_kwargs()
    tp = kwargs["tensor_model_parallel_size"]
    for field in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
                  "linear_num_value_heads", "intermediate_size", "vocab_size"):
        _check_divisible(hf[field], field, tp)
    if hf["linear_num_value_heads"] % hf["linear_num_key_heads"]:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    linear_pattern = [int(t == "linear_attention") for t in hf["layer_types"]]
    return TransformerConfig(
        **kwargs,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf["head_dim"],
        layernorm_epsilon=get(hf, "rms_norm_eps", 1e-6),
        layernorm_zero_centered_gamma=True,
        qk_layernorm=True,
        attention_output_gate=True,
        add_qkv_bias=get(hf, "attention_bias", False),
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=linear_pattern,
        linear_conv_kernel_dim=hf["linear_conv_kernel_dim"],
        linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_head_dim=hf["linear_value_head_dim"],
        linear_num_key_heads=hf["linear_num_key_heads"],
        linear_num_value_heads=hf["linear_num_value_heads"],
    )


def _norm(backend, plain: bool = False):
    if backend.fuse_layernorm_and_linear():  # Transformer Engine
        return PlainTENorm if plain else backend.layer_norm(rms_norm=True)
    return ModuleSpec(module=RMSNorm, params={"zero_centered_gamma": False}) if plain else RMSNorm


def _attention_spec(backend) -> tuple[ModuleSpec, bool]:
    fused = backend.fuse_layernorm_and_linear()
    qkv = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    spec = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=qkv,
            core_attention=SDPACoreAttention,
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=_norm(backend),
            k_layernorm=_norm(backend),
        ),
    )
    return spec, fused


def _gated_delta_net_spec(backend) -> tuple[ModuleSpec, bool]:
    fused = backend.fuse_layernorm_and_linear()
    in_proj = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    spec = ModuleSpec(
        module=LongStrawGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=in_proj, out_norm=_norm(backend, plain=True), out_proj=backend.row_parallel_linear()
        ),
    )
    return spec, fused


def block_spec(config: TransformerConfig, backend, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    """This pipeline stage's layer specs following ``linear_attention_freq`` (1 = Gated DeltaNet)."""
    fused = backend.fuse_layernorm_and_linear()
    mlp = partial(
        MLP.as_mlp_submodule,
        submodules=MLPSubmodules(
            linear_fc1=backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear(),
            linear_fc2=backend.row_parallel_linear(),
        ),
    )
    layers = []
    for is_linear in config.linear_attention_freq:
        mixer, fused_in = (_gated_delta_net_spec if is_linear else _attention_spec)(backend)
        layers.append(ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=IdentityOp if fused_in else _norm(backend),
                self_attention=mixer,
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=IdentityOp if fused else _norm(backend),
                mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        ))
    return TransformerBlockSubmodules(layer_specs=[layers[i] for i in local_layer_ids(config, vp_stage, pp_rank)],
                                      layer_norm=_norm(backend))


def gpt_model_kwargs(hf: dict) -> dict:
    """Vocabulary, RoPE and tying settings for ``GPTModel``."""
    rope = rope_parameters(hf)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{hf.get('_source', 'config')}: rope_type {rope['rope_type']!r} "
                         "is not supported for Qwen3.5 (only 'default')")
    return dict(
        vocab_size=hf["vocab_size"],
        max_sequence_length=get(hf, "max_position_embeddings", 262_144),
        position_embedding_type="rope",
        rotary_percent=get(rope, "partial_rotary_factor", 0.25),
        rotary_base=get(rope, "rope_theta", 10_000_000),
        share_embeddings_and_output_weights=get(hf, "tie_word_embeddings", False),
    )


def check_layout(hf: dict, parallel, rollout_source: str) -> None:
    """Parallel layouts this family refuses: none beyond ``transformer_config``'s divisibility
    checks (Qwen3.5 decodes under every layout)."""


# ----------------------------------------------------------------------------- FLOPs (for MFU)

def _mixer_flops(hf: dict, offset: float, tokens: float) -> float:
    """Attention and Gated DeltaNet FLOPs of ``tokens`` tokens after ``offset`` earlier ones."""
    n_attn = hf["layer_types"].count("full_attention")
    n_gdn = hf["layer_types"].count("linear_attention")
    flops = n_attn * causal_attention_flops(hf["num_attention_heads"], hf["head_dim"], hf["head_dim"], offset, tokens)
    flops += n_gdn * delta_rule_flops(hf["linear_num_value_heads"], hf["linear_key_head_dim"],
                                      hf["linear_value_head_dim"], tokens)
    return flops


def capture_flops(hf: dict, linear_elements: int, prompt_length: int) -> float:
    """Forward FLOPs of capturing a prompt (logits of the last position only), for
    ``linear_elements`` decoder linear weights (``flops.linear_weight_elements``)."""
    p = float(prompt_length)
    return (linear_flops(linear_elements, p) + _mixer_flops(hf, 0.0, p)
            + logits_flops(hf["hidden_size"], hf["vocab_size"], 1))


def response_flops(hf: dict, linear_elements: int, prompt_length: int, response_tokens: int) -> float:
    """Forward FLOPs of ``response_tokens`` tokens of one response after the prompt: linear
    layers, attention over the prompt plus the causal response part, Gated DeltaNet, logits."""
    r = float(response_tokens)
    return (linear_flops(linear_elements, r) + _mixer_flops(hf, float(prompt_length), r)
            + logits_flops(hf["hidden_size"], hf["vocab_size"], r))


def prompt_flops(hf: dict, model, prompt_length: int) -> float:
    """Forward FLOPs of capturing a ``prompt_length`` prompt on ``model``."""
    return capture_flops(hf, linear_weight_elements(model), prompt_length)


def response_forward_flops(hf: dict, model, prompt_length: int, response_tokens: int) -> float:
    """Forward FLOPs of one response of ``response_tokens`` tokens after a ``prompt_length`` prompt."""
    return response_flops(hf, linear_weight_elements(model), prompt_length, response_tokens)


# ----------------------------------------------------------------------------- planning profile
# Activation bytes per token (bf16, the benchmark's GPU setup: cuDNN SDPA, fla, Megatron's
# ``jit_fuser`` helpers compiled by Inductor). Each term names what keeps it; a saved view counts
# its whole base storage, as the meter counts. Basis: the meter's storages per module on CPU (norms,
# linears, MLP, RoPE, core attention through the emulated fused path), fla 0.6.0's autograd
# Functions read for Gated DeltaNet (``causal_conv1d``: its input view; ``l2norm``: output and
# rstd; ``chunk_gated_delta_rule``: q, k, v, cumulated g, beta, the 64-wide A), Inductor's
# partition of the compiled helpers run on CPU (each keeps its bf16 inputs and the norm's rstd).
# Their sum reproduces the H200 replay of qwen3.5-0.8b (19.754 GiB per 8,192 tokens), its PP=2
# stage 0 (9.838 GiB) and qwen3.6-27b cut to 4 layers (12.714 GiB) within 1e-4, the exact mode's
# swept 32K and 16K chunks (78.97 and 39.50 GiB) within 1e-3 (tests/test_plan_profile.py); the CP=2
# replay is the CP=1 one (each rank replays the whole response, no merge keeps more). Not counted:
# per-call constants (the conv's start state, ``kernel x channels`` bf16; in the sweep the
# recurrent chunk-start state, about 1 MiB per layer).

def _attention_saved_bytes(hf: dict) -> int:
    """A full-attention layer's mixer per token (``_attention_spec``)."""
    hidden, heads, groups, dim = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    q, kv = heads * dim, groups * dim
    rotary = int(dim * get(rope_parameters(hf), "partial_rotary_factor", 0.25))
    # the gate's reshape from its KV-group layout copies unless there is one group (then a view
    # of linear_qkv's output, which the compiled gate keeps whole)
    gate = 2 * q if groups > 1 else 2 * (2 * q + 2 * kv)
    return (2 * hidden                                   # linear_qkv input
            + heads * rms_norm_saved_bytes(dim)          # q_layernorm, per head
            + groups * rms_norm_saved_bytes(dim)         # k_layernorm, per group
            + 4 * 2 * rotary                             # RoPE's bf16 cos and sin, for q and for k
            + 3 * 2 * q + 2 * q + 4 * heads              # fused SDPA: q, k and v per query head, out, fp32 LSE
            + 2 * q + gate                               # compiled output gate: its inputs
            + 2 * q)                                     # linear_proj input


def _gated_delta_net_saved_bytes(hf: dict) -> int:
    """A Gated DeltaNet layer's mixer per token (``LongStrawGatedDeltaNet.forward`` on fla)."""
    hidden = hf["hidden_size"]
    heads_k, heads_v = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dim_k, dim_v = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    qk, v = heads_k * dim_k, heads_v * dim_v
    return (2 * hidden                                   # in_proj input
            + 2 * (2 * qk + 2 * v + 2 * heads_v)         # in_proj output: the conv keeps its qkv view
            + 2 * (2 * qk) + 4 * 2 * heads_k             # fla l2norm of q and k: output, fp32 rstd per head row
            + 2 * 2 * heads_v * dim_k + 2 * v            # the delta rule's q, k (value heads) and v
            + 4 * heads_v + 2 * heads_v                  # its fp32 chunk-cumulated decay, beta
            + 2 * DELTA_RULE_CHUNK * heads_v             # its bf16 A ([tokens, heads, chunk])
            + 2 * heads_v                                # compiled decay: its alpha input
            + 2 * v + 2 * v + 4 * heads_v                # compiled gated norm: core output, gate, rstd
            + 2 * v)                                     # out_proj input


def plan_profile(hf: dict) -> ModelProfile:
    """The budget planner's description of a Qwen3.5 config (``models/profile.py``), from the
    raw config alone: the parameters ``block_spec`` builds (local spec), the prompt state of each
    layer kind (``AttentionKVState``, ``GatedDeltaState``), the mixer FLOPs of ``_mixer_flops``
    and the bytes autograd keeps per token (above). ``ValueError`` for an invalid config."""
    hf = normalize_hf_config(hf)
    hidden, ffn, vocab = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    heads, groups, dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    heads_k, heads_v = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dim_k, dim_v, kernel = hf["linear_key_head_dim"], hf["linear_value_head_dim"], hf["linear_conv_kernel_dim"]
    norms = 2 * hidden                                   # input_layernorm, pre_mlp_layernorm
    mlp = 3 * ffn * hidden                               # linear_fc1 [gate; up], linear_fc2
    mlp_bytes = 2 * rms_norm_saved_bytes(hidden) + swiglu_mlp_saved_bytes(hidden, ffn)  # + the layer's norms
    hidden_bytes = 2 * rms_norm_saved_bytes(hidden) + 2 * 2 * hidden  # the norms, the mixer's and MLP's inputs

    qkv_rows = (2 * heads + 2 * groups) * dim            # [q, gate, k, v]
    attention_linear = qkv_rows * hidden + hidden * heads * dim + mlp
    attention_bias = qkv_rows if get(hf, "attention_bias", False) else 0  # column-parallel: sharded
    attention_norms = norms + 2 * dim                    # + per-head q/k norms
    attention_bytes = _attention_saved_bytes(hf) + mlp_bytes
    attention = LayerProfile(
        mixer="attention", moe=False,
        params=attention_linear + attention_bias + attention_norms, expert_params=0,
        replicated_params=attention_norms, active_linear_params=attention_linear,
        state_bytes_per_token=2 * 2 * groups * dim, state_bytes_fixed=0,  # bf16 K and V pages
        grad_state_elements_per_token=2 * groups * dim, grad_state_elements_fixed=0,
        tp_sharded_state=True, attention_pair_flops=2.0 * heads * (dim + dim), sparse_topk=0,
        indexer_pair_flops=0.0, delta_rule_flops_per_token=0.0, delta_rule_heads=0,
        replay_activation_bytes_per_token=attention_bytes, sweep_activation_bytes_per_token=attention_bytes,
        replay_hidden_bytes_per_token=hidden_bytes,
    )

    qk, v = heads_k * dim_k, heads_v * dim_v
    conv_channels = 2 * qk + v
    gdn_linear = (2 * qk + 2 * v + 2 * heads_v) * hidden + hidden * v + mlp  # in_proj, out_proj, MLP
    gdn_other = conv_channels * kernel + 2 * heads_v     # depthwise conv1d (no bias), dt_bias, A_log: sharded
    gdn_norms = norms + dim_v                            # + the gated output norm
    recurrent, tail = heads_v * dim_k * dim_v, conv_channels * (kernel - 1)
    gdn_bytes = _gated_delta_net_saved_bytes(hf) + mlp_bytes
    gated_delta_net = LayerProfile(
        mixer="gated_delta_net", moe=False,
        params=gdn_linear + gdn_other + gdn_norms, expert_params=0,
        replicated_params=gdn_norms, active_linear_params=gdn_linear,
        state_bytes_per_token=0.0, state_bytes_fixed=4 * recurrent + 2 * tail,  # fp32 state, bf16 tail
        grad_state_elements_per_token=0.0, grad_state_elements_fixed=recurrent + tail,
        tp_sharded_state=True, attention_pair_flops=0.0, sparse_topk=0, indexer_pair_flops=0.0,
        delta_rule_flops_per_token=delta_rule_flops(heads_v, dim_k, dim_v, 1), delta_rule_heads=heads_v,
        replay_activation_bytes_per_token=gdn_bytes, sweep_activation_bytes_per_token=gdn_bytes,
        replay_hidden_bytes_per_token=hidden_bytes,
    )

    tied = get(hf, "tie_word_embeddings", False)
    return ModelProfile(
        name=profile_name(hf), hidden_size=hidden, vocab_size=vocab,
        embedding_params=vocab * hidden, output_params=0 if tied else vocab * hidden, final_norm_params=hidden,
        layers=tuple(attention if t == "full_attention" else gated_delta_net for t in hf["layer_types"]),
        logits_bytes_per_token=replay_output_bytes(hidden), num_experts=0,
        tp_divisors=(heads, groups, heads_k, heads_v, ffn, vocab),  # transformer_config's checks
        sweep_final_norm_bytes_per_token=rms_norm_saved_bytes(hidden),
        last_hidden_state_bytes=2 * hidden, last_hidden_grad_elements=hidden,
    )


# ----------------------------------------------------------------------------- HF side

_HF_TEXT_MODEL = ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5ForCausalLM",
                  "transformers.models.qwen3_5.configuration_qwen3_5", "Qwen3_5TextConfig")


def hf_reference(model_type: str) -> tuple[str, str, str, str] | None:
    """``(modeling module, model class, configuration module, config class)`` of the transformers
    text model, the reference of the parity tests; ``None`` for the multimodal ``qwen3_5``
    wrapper (its normalized config, ``qwen3_5_text``, has the reference)."""
    return None if model_type == "qwen3_5" else _HF_TEXT_MODEL


def hf_output_config(hf: dict) -> dict:
    """The ``config.json`` written next to converted weights: the text model's config
    (``Qwen3_5ForCausalLM``) for a multimodal ``qwen3_5`` config, whose vision tower is not in
    the Megatron checkpoint; any other config as given."""
    if hf.get("model_type") == "qwen3_5":
        config = {k: v for k, v in normalize_hf_config(hf).items() if not k.startswith("_")}
        config["architectures"] = [_HF_TEXT_MODEL[1]]
        return config
    return {k: v for k, v in hf.items() if not k.startswith("_")}


# ----------------------------------------------------------------------------- weight mapping

_HF_PREFIXES = ("model.language_model.", "model.")


def _strip_prefix(name: str) -> str | None:
    for prefix in _HF_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def _qkv_to_mcore(q_gate, k, v, hf) -> torch.Tensor:
    heads, groups, dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    per_group = heads // groups
    q_gate = q_gate.reshape(groups, per_group, 2, dim, -1)
    q, gate = q_gate[:, :, 0], q_gate[:, :, 1]
    k, v = k.reshape(groups, 1, dim, -1), v.reshape(groups, 1, dim, -1)
    fused = torch.cat([q.reshape(groups, per_group * dim, -1), gate.reshape(groups, per_group * dim, -1),
                       k.reshape(groups, dim, -1), v.reshape(groups, dim, -1)], dim=1)
    return fused.reshape(-1, fused.shape[-1])


def _qkv_to_hf(fused, hf) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, groups, dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    per_group = heads // groups
    fused = fused.reshape(groups, (2 * per_group + 2) * dim, -1)
    q, gate, k, v = torch.split(fused, [per_group * dim, per_group * dim, dim, dim], dim=1)
    q_gate = torch.stack([q.reshape(groups, per_group, dim, -1),
                          gate.reshape(groups, per_group, dim, -1)], dim=2)
    return q_gate.reshape(heads * 2 * dim, -1), k.reshape(groups * dim, -1), v.reshape(groups * dim, -1)


# (HF suffix within a layer, Megatron suffix within a layer) for one-to-one tensors
_LAYER_RENAMES = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
    ("linear_attn.conv1d.weight", "self_attention.conv1d.weight"),
    ("linear_attn.dt_bias", "self_attention.dt_bias"),
    ("linear_attn.A_log", "self_attention.A_log"),
    ("linear_attn.norm.weight", "self_attention.out_norm.weight"),
    ("linear_attn.out_proj.weight", "self_attention.out_proj.weight"),
)
_GDN_IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def hf_group(name: str, hf: dict) -> str | None:
    """Group of an HF checkpoint tensor: tensors of one group convert together (fused q/k/v,
    GDN ``in_proj_*``, MLP gate/up); ``None`` for tensors outside the text model (vision tower,
    MTP heads), which ``hf_to_mcore`` drops. Used to stream a checkpoint a group at a time."""
    short = _strip_prefix(name)
    if short is not None and short.startswith(("visual.", "mtp.")):
        return None
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", short or "")
    if match:
        layer, suffix = match.groups()
        if suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            return f"layers.{layer}.mlp.linear_fc1"
        if suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            return f"layers.{layer}.self_attention.linear_qkv"
        if suffix in tuple(f"linear_attn.{p}.weight" for p in _GDN_IN_PROJ):
            return f"layers.{layer}.self_attention.in_proj"
    return name


def _pop_group(tensors: dict, names: list[str], index: int) -> list[torch.Tensor] | None:
    """Pop a fused group's tensors: all of them, or None when none is present."""
    present = [n for n in names if n in tensors]
    if not present:
        return None
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"HF weights lack 'model.layers.{index}.{missing[0]}' "
                         f"(needed with 'model.layers.{index}.{present[0]}')")
    return [tensors.pop(n) for n in names]


def hf_to_mcore(hf_state: dict[str, torch.Tensor], hf: dict, *, partial: bool = False
                ) -> dict[str, torch.Tensor]:
    """HF weights (``model.`` or ``model.language_model.`` prefix) -> full Megatron weights.

    ``partial=True`` converts any union of whole ``hf_group`` groups (streaming); the mapping
    itself is the same, Qwen3.5 has no whole-model checks.
    """
    hf = normalize_hf_config(hf)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if name == "lm_head.weight":
            if not get(hf, "tie_word_embeddings", False):
                out["output_layer.weight"] = tensor
            continue
        short = _strip_prefix(name)
        if short is None:
            raise ValueError(f"unexpected HF weight {name!r}")
        if short.startswith(("visual.", "mtp.")):
            continue  # vision tower and MTP heads are not part of the text model
        if short == "embed_tokens.weight":
            out["embedding.word_embeddings.weight"] = tensor
        elif short == "norm.weight":
            out["decoder.final_layernorm.weight"] = tensor
        elif match := re.fullmatch(r"layers\.(\d+)\.(.+)", short):
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        else:
            raise ValueError(f"unexpected HF weight {name!r}")
    renames = dict(_LAYER_RENAMES)
    for index, tensors in sorted(layers.items()):
        if index >= hf["num_hidden_layers"]:
            raise ValueError(f"unexpected HF weight 'model.layers.{index}.{next(iter(tensors))}' "
                             f"(the config has {hf['num_hidden_layers']} layers)")
        prefix = f"decoder.layers.{index}."
        mlp = _pop_group(tensors, ["mlp.gate_proj.weight", "mlp.up_proj.weight"], index)
        if mlp is not None:
            out[prefix + "mlp.linear_fc1.weight"] = torch.cat(mlp, dim=0)
        if hf["layer_types"][index] == "full_attention":
            qkv = _pop_group(tensors, [f"self_attn.{p}_proj.weight" for p in "qkv"], index)
            if qkv is not None:
                out[prefix + "self_attention.linear_qkv.weight"] = _qkv_to_mcore(*qkv, hf)
        else:
            in_proj = _pop_group(tensors, [f"linear_attn.{p}.weight" for p in _GDN_IN_PROJ], index)
            if in_proj is not None:
                out[prefix + "self_attention.in_proj.weight"] = torch.cat(in_proj, dim=0)
        for suffix, tensor in tensors.items():
            if suffix not in renames:
                raise ValueError(f"unexpected HF weight 'model.layers.{index}.{suffix}'")
            out[prefix + renames[suffix]] = tensor
    return out


def mcore_to_hf(mcore_state: dict[str, torch.Tensor], hf: dict, *,
                checkpoint_layout: bool = False) -> dict[str, torch.Tensor]:
    """Full Megatron weights -> HF ``Qwen3_5ForCausalLM`` weights (inverse of ``hf_to_mcore``).

    Works on any subset of Megatron weights. ``checkpoint_layout=True`` gives the names an HF
    checkpoint file holds: a tied ``lm_head.weight`` is left out (``save_pretrained`` drops it).
    """
    hf = normalize_hf_config(hf)
    renames = {mc: hf_name for hf_name, mc in _LAYER_RENAMES}
    qk = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    v = hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
    split = [2 * qk + v, v, hf["linear_num_value_heads"], hf["linear_num_value_heads"]]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in mcore_state.items():
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = tensor
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = tensor
        elif name == "output_layer.weight":
            out["lm_head.weight"] = tensor
        elif match := re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name):
            prefix, suffix = f"model.layers.{match.group(1)}.", match.group(2)
            if suffix == "mlp.linear_fc1.weight":
                gate, up = torch.chunk(tensor, 2, dim=0)
                out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
            elif suffix == "self_attention.linear_qkv.weight":
                for p, t in zip("qkv", _qkv_to_hf(tensor, hf)):
                    out[prefix + f"self_attn.{p}_proj.weight"] = t
            elif suffix == "self_attention.in_proj.weight":
                for p, t in zip(_GDN_IN_PROJ, torch.split(tensor, split, dim=0)):
                    out[prefix + f"linear_attn.{p}.weight"] = t
            elif suffix in renames:
                out[prefix + renames[suffix]] = tensor
            else:
                raise ValueError(f"unexpected Megatron weight {name!r}")
        else:
            raise ValueError(f"unexpected Megatron weight {name!r}")
    tied = get(hf, "tie_word_embeddings", False)
    if tied and not checkpoint_layout and "model.embed_tokens.weight" in out:
        out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return {k: v.contiguous() for k, v in out.items()}


def tp_sections(name: str, config: TransformerConfig) -> list[int] | None:
    """Full-size sections of fused tensors that TP splits section by section."""
    qk = config.linear_num_key_heads * config.linear_key_head_dim
    v = config.linear_num_value_heads * config.linear_value_head_dim
    if name.endswith("self_attention.in_proj.weight"):
        return [qk, qk, v, v, config.linear_num_value_heads, config.linear_num_value_heads]
    if name.endswith("self_attention.conv1d.weight"):
        return [qk, qk, v]
    if name.endswith("mlp.linear_fc1.weight"):
        return [config.ffn_hidden_size, config.ffn_hidden_size]
    return None
