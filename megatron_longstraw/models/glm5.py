"""GLM-5 family (HF ``glm_moe_dsa``): MLA + DeepSeek sparse attention (DSA) + sigmoid MoE.

Every layer is Megatron's ``AbsorbedMLASelfAttention`` with ``DSAttention`` as core attention
(the layout of Megatron's own ``get_dsa_module_spec_for_backend``: duplicated down projections;
the local spec uses ``glm5_layers.GlmAbsorbedMLASelfAttention`` for that, and absorbed MLA needs
``--sequence-parallel`` whenever TP > 1); the MLP is a SwiGLU ``MLP``
for the first ``first_k_dense_replace`` layers (HF ``mlp_layer_types == "dense"``) and Megatron's
``MoELayer`` otherwise (``moe_layer_freq`` list). How HF semantics map onto Megatron settings:

- MLA: ``q_a_proj -> q_a_layernorm -> q_b_proj`` and ``kv_a_proj_with_mqa -> kv_a_layernorm ->
  kv_b_proj`` are Megatron's q/kv down/up projections with ``qk_layernorm``; per-head layouts
  (``[nope, rope]`` for q, ``[k_nope, v]`` for kv_b) are identical, so weights map one to one.
  HF applies RoPE to the rope slice with ``apply_rotary_pos_emb_interleave`` (pairs
  ``(x0, x1), ...`` rotated, output de-interleaved): that is exactly Megatron's
  ``mla_rotary_interleaved`` path (always on in MLA). HF's latent norms use eps 1e-6, not
  ``rms_norm_eps`` (see ``glm5_layers.fixed_eps_norm``). Softmax scale ``1/sqrt(nope + rope)``.
- DSA indexer: ``wq_b`` (from the normed q latent), ``wk`` + LayerNorm(eps 1e-6, with bias),
  interleaved RoPE on the first ``qk_rope_head_dim`` dims (``dsa_indexer_rope_interleaved``),
  ``relu(q.k) * w * n_heads^-0.5 * head_dim^-0.5`` summed over heads (``dsa_indexer_scoring_relu``;
  no Hadamard rotation), causal mask, top-``index_topk`` (exact score ties broken by position,
  ``patches.dsa_causal_topk``, so a selection never depends on later tokens); attention is causal
  AND top-k.
- ``indexer_types``: a ``"shared"`` layer reuses the top-k of the most recent ``"full"`` layer
  (HF passes ``topk_indices`` down the stack). Megatron's ``dsa_indexer_topk_freq`` /
  ``dsa_indexer_skip_topk_offset`` express the periodic patterns HF derives from
  ``index_topk_freq`` / ``index_skip_topk_offset`` (same formula, same source layer); an
  arbitrary pattern is refused with a ValueError.
- Router: ``sigmoid`` scores, ``e_score_correction_bias`` -> ``expert_bias`` (buffer, routing
  only), group-limited routing (HF sums the top-2 scores of a group; Megatron the top
  ``topk // group_topk``, so a restricting grouping needs ``topk // topk_group == 2``), top-k
  weights renormalized (Megatron always does for sigmoid, so ``norm_topk_prob`` must be true),
  times ``routed_scaling_factor`` (``moe_router_topk_scaling_factor``); router math in fp32 (fp64
  for fp64 parameters, so fp64 tests are fp64 throughout).
- Experts: HF ``gate_up_proj[e]`` is ``[gate; up]`` = Megatron's fused ``linear_fc1`` of
  ``SequentialMLP`` expert ``e``; the shared expert is ``moe_shared_expert_intermediate_size``.
- The full state dict uses GLOBAL expert numbers in ``local_experts.{e}``; ``load_full_state_dict``
  keeps the experts of this EP rank and renumbers them.
- The router's ``expert_bias`` keeps Megatron's aux-loss-free update (``moe_router_bias_update_rate``)
  when training runs ``finalize_model_grads``; Megatron only counts tokens for it with grad
  enabled, so LongStraw capture (no grad) neither counts prompt tokens nor changes the bias;
  replay counts response tokens (padding of a micro-batch included; the full-graph baseline also
  counts the prompt once per response); RoPE: ``rope_type`` ``default`` only (YaRN refused).
- ``--prompt-gradient exact`` (MoE): the reverse sweep's recomputed prompt chunk routes every
  token as the full graph does (routing is per token, no capacity or token dropping, the same
  ``expert_bias``: it only changes at the optimizer step), so gradients are exact. What differs
  is the expert-bias token count: the sweep runs with grad, so it counts every prompt token once
  (under sequence parallelism a chunk's padding rows too; expert-parallel idle rounds count
  nothing; capture counts none; the full-graph baseline counts the prompt once per response,
  detached replay never), and the step's bias update sees the prompt's routing once. Aux, sequence-aux
  and z losses, which a recompute would add once more, are off for GLM-5
  (``moe_router_load_balancing_type="none"``, ``moe_aux_loss_coeff=0``, no z-loss).
- LongStraw prompt state (``glm5_state``): per layer the MLA latent ``[c_kv ; k_rope]`` of every
  prompt token, plus the DSA indexer keys on layers with their own indexer (not "shared" ones).
- HF checkpoints carry an MTP layer (``model.layers.{num_hidden_layers}.*``) that HF's own model
  ignores; it is dropped here as well, with a warning.
"""

import re
import warnings

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    _validate_dsa_index_share_pipeline_split,
)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
    AbsorbedMLASelfAttentionSubmodules,
)
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerSubmodules,
    DSAttentionSubmodules,
    is_dsa_skip_topk_layer,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_longstraw.models.glm5_layers import (
    DuplicatedLinear,
    GlmAbsorbedMLASelfAttention,
    IndexerLayerNorm,
    LongStrawAbsorbedMLASelfAttention,
    LongStrawDSAIndexer,
    LongStrawDSAttention,
    fixed_eps_norm,
)
from megatron_longstraw.models.flops import active_linear_weight_elements, linear_flops, logits_flops
from megatron_longstraw.models.hf_config import get, require, rope_parameters
from megatron_longstraw.models.norms import RMSNorm
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.pipeline_stage import local_layer_ids
from megatron_longstraw.models.profile import (LayerProfile, ModelProfile, profile_name, replay_output_bytes,
                                            rms_norm_saved_bytes, swiglu_mlp_saved_bytes)

MODEL_TYPES = ("glm_moe_dsa",)
FAMILY = "GLM-5"

_REQUIRED = (
    "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "vocab_size",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "index_topk", "index_head_dim", "index_n_heads", "indexer_types", "mlp_layer_types",
)
HF_LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with the class default eps
HF_INDEXER_NORM_EPS = 1e-6  # HF's indexer k_norm is nn.LayerNorm(index_head_dim, eps=1e-6)


def _fail(hf: dict, message: str):
    raise ValueError(f"{hf.get('_source', 'config')}: {message}")


def normalize_hf_config(hf: dict) -> dict:
    """Fill HF's derived fields (``indexer_types``, ``mlp_layer_types``) as HF does; validate."""
    hf = dict(hf)
    for alias in ("num_local_experts", "num_experts"):
        if hf.get("n_routed_experts") is None and hf.get(alias) is not None:
            hf["n_routed_experts"] = hf[alias]
    layers = hf.get("num_hidden_layers")
    if hf.get("indexer_types") is None and layers:
        pattern = hf.get("index_topk_pattern")
        if pattern is not None:
            hf["indexer_types"] = ([{"F": "full", "S": "shared"}[c] for c in pattern]
                                   if isinstance(pattern, str) else list(pattern))
        else:  # HF GlmMoeDsaConfig.__post_init__
            freq = max(get(hf, "index_topk_freq", 1), 1)
            offset = get(hf, "index_skip_topk_offset", 2)
            hf["indexer_types"] = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                                   for i in range(layers)]
    if hf.get("mlp_layer_types") is None and layers:
        dense = min(get(hf, "first_k_dense_replace", 3), layers)
        hf["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (layers - dense)
    require(hf, _REQUIRED, FAMILY)
    for field, allowed in (("indexer_types", ("full", "shared")), ("mlp_layer_types", ("dense", "sparse"))):
        values = hf[field]
        if len(values) != layers or any(v not in allowed for v in values):
            _fail(hf, f"{field} must list {layers} entries from {allowed}, got {list(values)[:8]}...")
    if hf["indexer_types"][0] != "full":
        _fail(hf, "indexer_types[0] must be 'full' (a shared layer needs an earlier full layer)")
    return hf


def _indexer_share_schedule(hf: dict) -> tuple[int, int]:
    """``(dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset)`` reproducing ``indexer_types``."""
    types = hf["indexer_types"]
    layers = len(types)
    if all(t == "full" for t in types):
        return 1, 0
    for freq in range(2, layers + 1):
        for offset in range(1, layers + 1):
            pattern = ["shared" if is_dsa_skip_topk_layer(i + 1, offset, freq) else "full"
                       for i in range(layers)]
            if pattern == list(types):
                return freq, offset
    _fail(hf, "indexer_types is not a periodic full/shared pattern (index_topk_freq / "
              "index_skip_topk_offset); Megatron's DSA top-k sharing cannot express it")


def _check_divisible(value: int, what: str, size: int, flag: str) -> None:
    if value % size:
        raise ValueError(f"{what} ({value}) is not divisible by {flag} {size}")


def _rope_kwargs(hf: dict) -> dict:
    rope = rope_parameters(hf)
    rope_type = rope.get("rope_type", "default")
    theta = get(rope, "rope_theta", 10_000.0)
    if get(rope, "partial_rotary_factor", 1.0) != 1.0:
        _fail(hf, "partial_rotary_factor != 1 is not supported for GLM-5 (RoPE covers qk_rope_head_dim)")
    if rope_type == "default":
        # rotary_scaling_factor / mscale_all_dim make Megatron's softmax mscale exactly 1.0
        return dict(rope_type="rope", rotary_base=theta, rotary_percent=1.0,
                    rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    _fail(hf, f"rope_type {rope_type!r} is not supported for GLM-5 (only 'default')")


def _routing_kwargs(hf: dict) -> dict:
    experts, topk = hf["n_routed_experts"], hf["num_experts_per_tok"]
    groups, group_topk = get(hf, "n_group", 1), get(hf, "topk_group", 1)
    if not get(hf, "norm_topk_prob", True):
        _fail(hf, "norm_topk_prob=false is not supported (Megatron's sigmoid router renormalizes)")
    if topk < 2:
        _fail(hf, "num_experts_per_tok must be >= 2 (Megatron skips renormalizing a single expert)")
    if experts % groups or experts // groups < 2 or not 1 <= group_topk <= groups:
        _fail(hf, f"n_group ({groups}) / topk_group ({group_topk}) do not fit {experts} experts")
    if group_topk == groups:  # every group is kept: plain top-k
        return dict(moe_router_num_groups=None, moe_router_group_topk=None)
    if topk // group_topk != 2:
        _fail(hf, f"group-limited routing needs num_experts_per_tok // topk_group == 2 (HF scores "
                  f"a group by its top-2 experts), got {topk} // {group_topk}")
    return dict(moe_router_num_groups=groups, moe_router_group_topk=group_topk)


def transformer_config(hf: dict, options: ModelOptions) -> MLATransformerConfig:
    """Megatron ``MLATransformerConfig`` for a normalized GLM-5 config (validated)."""
    hf = normalize_hf_config(hf)
    kwargs = options.config_kwargs()
    tp, ep = kwargs["tensor_model_parallel_size"], kwargs["expert_model_parallel_size"]
    tp_flag = "--tensor-model-parallel-size"
    for field in ("num_attention_heads", "intermediate_size", "moe_intermediate_size",
                  "vocab_size", "q_lora_rank"):
        _check_divisible(hf[field], field, tp, tp_flag)
    _check_divisible(hf["kv_lora_rank"] + hf["qk_rope_head_dim"],
                     "kv_lora_rank + qk_rope_head_dim", tp, tp_flag)
    _check_divisible(hf["n_routed_experts"], "n_routed_experts", ep, "--expert-model-parallel-size")
    if tp > 1 and not kwargs["sequence_parallel"]:
        raise ValueError("GLM-5 (Megatron's absorbed MLA) needs --sequence-parallel when "
                         "--tensor-model-parallel-size > 1")
    if get(hf, "num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
        _fail(hf, "num_key_value_heads must equal num_attention_heads (MLA has one KV per head)")
    for flag in ("attention_bias", "mlp_bias"):
        if get(hf, flag, False):
            _fail(hf, f"{flag}=true is not supported for GLM-5")
    if get(hf, "hidden_act", "silu") != "silu":
        _fail(hf, f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    if hf["index_head_dim"] < hf["qk_rope_head_dim"]:
        _fail(hf, "index_head_dim must be >= qk_rope_head_dim")
    topk_freq, skip_offset = _indexer_share_schedule(hf)
    shared = get(hf, "n_shared_experts", 1)
    return MLATransformerConfig(
        **kwargs,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        layernorm_epsilon=get(hf, "rms_norm_eps", 1e-5),
        # MLA
        multi_latent_attention=True,
        q_lora_rank=hf["q_lora_rank"],
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        qk_layernorm=True,
        **_rope_kwargs(hf),
        # DSA
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=hf["index_n_heads"],
        dsa_indexer_head_dim=hf["index_head_dim"],
        dsa_indexer_topk=hf["index_topk"],
        dsa_indexer_topk_freq=topk_freq,
        dsa_indexer_skip_topk_offset=skip_offset,
        dsa_indexer_rope_interleaved=True,
        dsa_indexer_rotate_activation=False,
        dsa_indexer_scoring_relu=True,
        dsa_indexer_k_norm_epsilon=HF_INDEXER_NORM_EPS,
        # Megatron's own (unbound) DSA forward under CP all-gathers; LongStraw's capture/replay
        # shard the prompt state themselves (attention/cp_sparse_attention.py)
        cp_comm_type="allgather" if kwargs["context_parallel_size"] > 1 else None,
        # MoE
        num_moe_experts=hf["n_routed_experts"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_layer_freq=[int(t == "sparse") for t in hf["mlp_layer_types"]],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=get(hf, "routed_scaling_factor", 1.0),
        moe_router_dtype="fp64" if kwargs["params_dtype"] == torch.float64 else "fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * shared if shared else None,
        moe_token_dispatcher_type="alltoall" if ep > 1 else "allgather",
        moe_grouped_gemm=False,
        **_routing_kwargs(hf),
    )


# ----------------------------------------------------------------------------- layer specs


def attention_spec(config: TransformerConfig, backend) -> ModuleSpec:
    """``AbsorbedMLASelfAttention`` + ``DSAttention``/``DSAIndexer`` for the given backend.

    Transformer Engine: Megatron's ``get_dsa_module_spec_for_backend`` layout (duplicated
    ``TELinear`` down projections and indexer linears, ``TENorm``). Local: the same layout with
    ``DuplicatedLinear`` (through ``GlmAbsorbedMLASelfAttention``, see ``glm5_layers``) and the
    project's SP-aware ``RMSNorm``. The attention, core attention and indexer are the LongStraw
    subclasses (``glm5_layers``): Megatron's modules unless bound for capture/replay.
    """
    te = backend.fuse_layernorm_and_linear()
    if te:
        attention, duplicated = LongStrawAbsorbedMLASelfAttention, backend.linear()
        latent_norm = backend.layer_norm(rms_norm=True, for_qk=True)
        k_norm = backend.layer_norm(rms_norm=False, for_qk=True)
    else:
        attention, duplicated = GlmAbsorbedMLASelfAttention, DuplicatedLinear
        latent_norm, k_norm = RMSNorm, IndexerLayerNorm
    latent_norm = fixed_eps_norm(latent_norm, HF_LATENT_NORM_EPS)
    indexer = ModuleSpec(
        module=LongStrawDSAIndexer,
        submodules=DSAIndexerSubmodules(
            linear_wq_b=duplicated, linear_wk=duplicated, k_norm=k_norm,
            linear_weights_proj=duplicated,
        ),
    )
    return ModuleSpec(
        module=attention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=AbsorbedMLASelfAttentionSubmodules(
            linear_q_down_proj=duplicated,
            linear_q_up_proj=backend.column_parallel_linear(),
            linear_kv_down_proj=duplicated,
            linear_kv_up_proj=backend.column_parallel_linear(),
            core_attention=ModuleSpec(module=LongStrawDSAttention,
                                      submodules=DSAttentionSubmodules(indexer=indexer)),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=latent_norm,
            kv_layernorm=latent_norm,
        ),
    )


def block_spec(config: TransformerConfig, backend, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    """This pipeline stage's layer specs: DSA attention everywhere, dense MLP or MoE per
    ``moe_layer_freq``; norms are unfused RMSNorms (DSA needs the normed latents)."""
    te = backend.fuse_layernorm_and_linear()
    norm = backend.layer_norm(rms_norm=True) if te else RMSNorm
    attention = attention_spec(config, backend)
    dense = ModuleSpec(module=MLP, submodules=MLPSubmodules(
        linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear()))
    moe = get_moe_module_spec_for_backend(backend, num_experts=config.num_moe_experts,
                                          moe_grouped_gemm=False)
    layers = [
        ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=moe if is_moe else dense,
            mlp_bda=get_bias_dropout_add,
        ))
        for is_moe in config.moe_layer_freq
    ]
    local_ids = local_layer_ids(config, vp_stage, pp_rank)
    _validate_dsa_index_share_pipeline_split(config, local_ids)
    return TransformerBlockSubmodules(layer_specs=[layers[i] for i in local_ids], layer_norm=norm)


def gpt_model_kwargs(hf: dict) -> dict:
    """Vocabulary and tying for ``GPTModel`` (RoPE lives inside MLA, configured in the config)."""
    return dict(
        vocab_size=hf["vocab_size"],
        max_sequence_length=get(hf, "max_position_embeddings", 202_752),
        position_embedding_type="rope",  # GPTModel builds no rotary module for MLA
        share_embeddings_and_output_weights=get(hf, "tie_word_embeddings", False),
    )


def check_layout(hf: dict, parallel, rollout_source: str) -> None:
    """Parallel layouts this family refuses: none beyond ``transformer_config``'s checks (GLM-5
    decodes under every layout, context parallelism included)."""


# ----------------------------------------------------------------------------- FLOPs (for MFU)

def capture_flops(hf: dict, active_linear_elements: int, prompt_length: int) -> float:
    """Forward FLOPs of capturing a prompt: active linear weights (``flops.active_linear_weight_
    elements``), the DSA indexer's scores on layers with their own indexer (``2 * heads * d`` per
    visible query-key pair), absorbed sparse MLA over ``min(index_topk, position + 1)`` keys per
    query (scores over ``kv_lora_rank + rope``, values over ``kv_lora_rank``), last logits."""
    p = float(prompt_length)
    k = min(float(hf["index_topk"]), p)
    flops = linear_flops(active_linear_elements, p)
    own_indexers = hf["indexer_types"].count("full")
    flops += own_indexers * 2.0 * hf["index_n_heads"] * hf["index_head_dim"] * p * (p + 1) / 2
    keys_attended = k * p - k * (k - 1) / 2  # sum over positions of min(k, position + 1)
    latent = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
    flops += hf["num_hidden_layers"] * hf["num_attention_heads"] * 2.0 * (latent + hf["kv_lora_rank"]) * keys_attended
    flops += logits_flops(hf["hidden_size"], hf["vocab_size"], 1)
    return flops


def prompt_flops(hf: dict, model, prompt_length: int) -> float:
    """Forward FLOPs of capturing a ``prompt_length`` prompt on ``model`` (routed experts counted
    as ``num_experts_per_tok`` experts per token)."""
    return capture_flops(hf, active_linear_weight_elements(model, hf["num_experts_per_tok"]), prompt_length)


def response_forward_flops(hf: dict, model, prompt_length: int, response_tokens: int) -> None:
    """No response formula for GLM-5 yet (replay reports no MFU)."""
    return None


# ----------------------------------------------------------------------------- planning profile
# Activation bytes per token (bf16, the benchmark's GPU setup). GLM-5's replay runs the same torch
# code on CPU and GPU (the sparse MLA's fused kernel serves no-grad capture only; with grad the
# blockwise path checkpoints each query block, keeping its inputs), so the basis is the meter's
# storages per module of a replay on CPU (glm-5-mini cut to 4 layers, bf16). Their sum reproduces
# the H200 replay of glm-5-mini (11.820 GiB per 4,096 tokens) and its swept 4,096-token chunk
# (11.805 GiB) within 1e-4 (tests/test_plan_profile.py). Under CP > 1 the replay attends over
# every rank's pages (``cp_sparse_latent_attention``): ``_mla_cp_extra_bytes`` (17.84 GiB measured
# at CP=2, bench_glm-5-mini_cp2-1m.json, matched within 1e-3). The sweep under CP is not modeled.

def _mla_saved_bytes(hf: dict, own_indexer: bool) -> int:
    """An absorbed MLA + DSA layer's attention per token (``LongStrawAbsorbedMLASelfAttention``)."""
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    q_rank, kv_rank = hf["q_lora_rank"], hf["kv_lora_rank"]
    nope, rope, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    latent = kv_rank + rope
    return (2 * hidden                                   # the down projections' (shared) input
            + rms_norm_saved_bytes(q_rank) + 2 * q_rank  # q latent norm, linear_q_up_proj input
            + rms_norm_saved_bytes(kv_rank)              # kv latent norm
            + 2 * heads * (nope + rope)                  # q_up output, kept whole by the absorption's q_nope view
            + 4 * 2 * rope                               # RoPE's bf16 cos and sin, for q and for k
            + 2 * heads * latent + 2 * latent            # the checkpointed sparse blocks' inputs: absorbed q,
            + (8 * hf["index_topk"] if own_indexer else 0)  # new latents, int64 top-k (a shared layer: its source's)
            + 2 * heads * kv_rank                        # latent output, for the V up projection
            + 2 * heads * v)                             # linear_proj input


def _mla_cp_extra_bytes(hf: dict) -> int:
    """What an MLA layer's replay keeps more per token under CP > 1: the attention runs as fp32
    partials merged through their log-sum-exps (``partials``), keeping four fp32 ``[heads,
    kv_lora_rank]`` outputs (the pages' part, its merge over the group, the response's own part,
    their merge) instead of the normalized bf16 one, and per head a few fp32 weights and
    log-sum-exps (six, from the measured 17.84 GiB: 24 bytes per head)."""
    heads = hf["num_attention_heads"]
    return 4 * 4 * heads * hf["kv_lora_rank"] + 24 * heads


def _moe_saved_bytes(hf: dict) -> int:
    """A MoE MLP per token (``MoELayer``: sigmoid router in fp32, allgather dispatcher,
    ``SequentialMLP`` experts with the probabilities applied in them, the shared expert)."""
    hidden, experts, topk = hf["hidden_size"], hf["n_routed_experts"], hf["num_experts_per_tok"]
    ffn, shared = hf["moe_intermediate_size"], get(hf, "n_shared_experts", 1)
    groups, group_topk = get(hf, "n_group", 1), get(hf, "topk_group", 1)
    router = (4 * experts + 8 * topk + 4 + 4 * topk      # fp32 scores, int64 top-k, fp32 norm and weights
              + experts + 4 * experts + 8 * topk)        # dispatcher: bool map, fp32 probs, int64 permutation
    if group_topk < groups:                              # group-limited: per-group top-2, group top-k, mask
        router += 8 * groups * (topk // group_topk) + 8 * group_topk + experts
    routed = topk * (2 * hidden                          # per routed copy: fc1 input (the permuted tokens)
                     + 2 * (2 * ffn) + 2 * ffn + 2 * ffn  # the GLU as in the dense MLP
                     + 2 * ffn + 4                       # the probs multiply: GLU output, fp32 prob
                     + 2 * ffn)                          # fc2 input
    return router + routed + (swiglu_mlp_saved_bytes(hidden, ffn * shared) if shared else 0)


def plan_profile(hf: dict) -> ModelProfile:
    """The budget planner's description of a GLM-5 config (``models/profile.py``), from the raw
    config alone: the parameters ``block_spec`` builds (local spec; duplicated down projections
    and indexer linears, which every TP rank holds whole), the prompt state of ``glm5_state``,
    the FLOPs terms of ``capture_flops`` and the bytes autograd keeps per token (above).
    ``ValueError`` for an invalid config."""
    hf = normalize_hf_config(hf)
    hidden, heads, vocab = hf["hidden_size"], hf["num_attention_heads"], hf["vocab_size"]
    q_rank, kv_rank = hf["q_lora_rank"], hf["kv_lora_rank"]
    nope, rope, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    index_heads, index_dim, topk = hf["index_n_heads"], hf["index_head_dim"], hf["index_topk"]
    experts, per_token = hf["n_routed_experts"], hf["num_experts_per_tok"]
    ffn, moe_ffn, shared = hf["intermediate_size"], hf["moe_intermediate_size"], get(hf, "n_shared_experts", 1)
    latent = kv_rank + rope
    down = q_rank * hidden + latent * hidden             # linear_q_down_proj, linear_kv_down_proj: duplicated
    up = heads * (nope + rope) * q_rank + heads * (nope + v) * kv_rank + hidden * heads * v  # q/kv up, proj
    indexer_linear = index_heads * index_dim * q_rank + index_dim * hidden + index_heads * hidden  # duplicated
    norms = 2 * hidden + q_rank + kv_rank                # input, pre-MLP, q and kv latent norms

    def layer(own_indexer: bool, moe: bool) -> LayerProfile:
        attention_linear = down + up + (indexer_linear if own_indexer else 0)
        replicated = norms + down + (indexer_linear + 2 * index_dim if own_indexer else 0)  # + k_norm w, b
        if moe:
            router = experts * hidden                    # replicated, a linear of every token
            routed = experts * 3 * moe_ffn * hidden
            shared_expert = 3 * moe_ffn * shared * hidden
            mlp_params, expert_params = router + routed + shared_expert, routed
            active_mlp = router + shared_expert + per_token * 3 * moe_ffn * hidden
            replicated += router
            mlp_bytes = _moe_saved_bytes(hf)
        else:
            mlp_params, expert_params = 3 * ffn * hidden, 0
            active_mlp = mlp_params
            mlp_bytes = swiglu_mlp_saved_bytes(hidden, ffn)
        saved = _mla_saved_bytes(hf, own_indexer) + 2 * rms_norm_saved_bytes(hidden) + mlp_bytes
        return LayerProfile(
            mixer="mla_dsa", moe=moe,
            params=attention_linear + (2 * index_dim if own_indexer else 0) + norms + mlp_params,
            expert_params=expert_params, replicated_params=replicated,
            active_linear_params=attention_linear + active_mlp,
            # bf16 latent [c_kv; k_rope] per token, and the indexer key where the layer has its own
            state_bytes_per_token=2 * latent + (2 * index_dim if own_indexer else 0), state_bytes_fixed=0,
            grad_state_elements_per_token=latent, grad_state_elements_fixed=0,  # the indexer keys get none
            tp_sharded_state=False,                      # one MQA latent per token: replicated over TP
            attention_pair_flops=2.0 * heads * (latent + kv_rank), sparse_topk=topk,
            indexer_pair_flops=2.0 * index_heads * index_dim if own_indexer else 0.0,
            delta_rule_flops_per_token=0.0, delta_rule_heads=0,
            replay_activation_bytes_per_token=saved, sweep_activation_bytes_per_token=saved,
            replay_cp_extra_bytes_per_token=_mla_cp_extra_bytes(hf),
            # the norms, the mixer's and MLP's inputs (and the routed copies of each token)
            replay_hidden_bytes_per_token=2 * rms_norm_saved_bytes(hidden) + 2 * 2 * hidden
            + (2 * hidden * per_token if moe else 0),
        )

    layers = tuple(layer(indexer == "full", mlp == "sparse")
                   for indexer, mlp in zip(hf["indexer_types"], hf["mlp_layer_types"]))
    tied = get(hf, "tie_word_embeddings", False)
    return ModelProfile(
        name=profile_name(hf), hidden_size=hidden, vocab_size=vocab,
        embedding_params=vocab * hidden, output_params=0 if tied else vocab * hidden, final_norm_params=hidden,
        layers=layers, logits_bytes_per_token=replay_output_bytes(hidden), num_experts=experts,
        tp_divisors=(heads, ffn, moe_ffn, vocab, q_rank, latent),  # transformer_config's checks
        sweep_final_norm_bytes_per_token=rms_norm_saved_bytes(hidden),
        last_hidden_state_bytes=2 * hidden, last_hidden_grad_elements=hidden,
        # every CP rank replays the whole response (measured: glm-5-mini replays a 4,096-token
        # response in 8.5 s at CP=2 and 1M, 6.9 s at CP=1 and 512K: no faster)
        replay_splits_over_cp=False,
        tp_needs_sequence_parallel=True,  # transformer_config: MoE under TP needs --sequence-parallel
    )


# ----------------------------------------------------------------------------- HF side

def hf_reference(model_type: str) -> tuple[str, str, str, str]:
    """``(modeling module, model class, configuration module, config class)`` of the transformers
    model, the reference of the parity tests."""
    return ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaForCausalLM",
            "transformers.models.glm_moe_dsa.configuration_glm_moe_dsa", "GlmMoeDsaConfig")


def hf_output_config(hf: dict) -> dict:
    """The ``config.json`` written next to converted weights: the config as given."""
    return {k: v for k, v in hf.items() if not k.startswith("_")}


# ----------------------------------------------------------------------------- weight mapping

# (HF suffix within a layer, Megatron suffix within a layer) for one-to-one tensors
_ATTN = "self_attention."
_INDEXER = _ATTN + "core_attention.indexer."
_LAYER_RENAMES = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("self_attn.q_a_proj.weight", _ATTN + "linear_q_down_proj.weight"),
    ("self_attn.q_a_layernorm.weight", _ATTN + "q_layernorm.weight"),
    ("self_attn.q_b_proj.weight", _ATTN + "linear_q_up_proj.weight"),
    ("self_attn.kv_a_proj_with_mqa.weight", _ATTN + "linear_kv_down_proj.weight"),
    ("self_attn.kv_a_layernorm.weight", _ATTN + "kv_layernorm.weight"),
    ("self_attn.kv_b_proj.weight", _ATTN + "linear_kv_up_proj.weight"),
    ("self_attn.o_proj.weight", _ATTN + "linear_proj.weight"),
    ("self_attn.indexer.wq_b.weight", _INDEXER + "linear_wq_b.weight"),
    ("self_attn.indexer.wk.weight", _INDEXER + "linear_wk.weight"),
    ("self_attn.indexer.k_norm.weight", _INDEXER + "k_norm.weight"),
    ("self_attn.indexer.k_norm.bias", _INDEXER + "k_norm.bias"),
    ("self_attn.indexer.weights_proj.weight", _INDEXER + "linear_weights_proj.weight"),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
    ("mlp.gate.weight", "mlp.router.weight"),
    ("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias"),
    ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight"),
)
_GATE_UP = (  # HF (gate, up) pairs fused into Megatron's [gate; up] linear_fc1
    ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.linear_fc1.weight"),
    ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
     "mlp.shared_experts.linear_fc1.weight"),
)
_EXPERT = "mlp.experts.local_experts.{}.linear_fc{}.weight"


_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def hf_group(name: str, hf: dict) -> str | None:
    """Group of an HF checkpoint tensor: tensors of one group convert together (a gate/up pair
    of the dense MLP, the shared expert or one routed expert); ``None`` for MTP layers
    (``model.layers.{num_hidden_layers}.*`` and above), which ``hf_to_mcore`` drops."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not match:
        return name
    layer, suffix = int(match.group(1)), match.group(2)
    if layer >= normalize_hf_config(hf)["num_hidden_layers"]:
        return None
    if expert := _HF_EXPERT.fullmatch(suffix):
        if expert.group(2) != "down":
            return f"layers.{layer}.experts.{expert.group(1)}.linear_fc1"
    for gate, up, fused in _GATE_UP:
        if suffix in (gate, up):
            return f"layers.{layer}.{fused}"
    return name


def _pop_pair(tensors: dict, gate: str, up: str, index: int) -> torch.Tensor | None:
    """``[gate; up]`` popped from ``tensors``, or None when neither is present."""
    if gate not in tensors and up not in tensors:
        return None
    for have, need in ((gate, up), (up, gate)):
        if need not in tensors:
            raise ValueError(f"HF weights lack 'model.layers.{index}.{need}' "
                             f"(needed with 'model.layers.{index}.{have}')")
    return torch.cat([tensors.pop(gate), tensors.pop(up)], dim=0)


def hf_to_mcore(hf_state: dict[str, torch.Tensor], hf: dict, *, partial: bool = False
                ) -> dict[str, torch.Tensor]:
    """HF ``GlmMoeDsaForCausalLM`` weights -> full Megatron weights (local-spec names, global
    expert numbers). MTP weights (layers >= ``num_hidden_layers``) are dropped with a warning.

    Routed experts may come stacked (``mlp.experts.gate_up_proj`` / ``down_proj``, the
    transformers module layout) or one tensor per expert (``mlp.experts.{e}.gate_proj.weight``,
    the layout of HF checkpoint files). ``partial=True`` converts any union of whole
    ``hf_group`` groups (streaming) and skips the whole-model checks.
    """
    hf = normalize_hf_config(hf)
    num_layers = hf["num_hidden_layers"]
    layers: dict[int, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    dropped = []
    for name, tensor in hf_state.items():
        if name == "lm_head.weight":
            if not get(hf, "tie_word_embeddings", False):
                out["output_layer.weight"] = tensor
        elif name == "model.embed_tokens.weight":
            out["embedding.word_embeddings.weight"] = tensor
        elif name == "model.norm.weight":
            out["decoder.final_layernorm.weight"] = tensor
        elif match := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name):
            if int(match.group(1)) >= num_layers:
                dropped.append(name)
            else:
                layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        else:
            raise ValueError(f"unexpected HF weight {name!r}")
    if dropped and not partial:
        warnings.warn(f"GLM-5: dropping {len(dropped)} MTP weights (model.layers.{num_layers}.*); "
                      "multi-token prediction is not part of the Megatron model")
    renames = dict(_LAYER_RENAMES)
    for index, tensors in sorted(layers.items()):
        prefix = f"decoder.layers.{index}."
        for gate, up, fused in _GATE_UP:
            pair = _pop_pair(tensors, gate, up, index)
            if pair is not None:
                out[prefix + fused] = pair
        if "mlp.experts.gate_up_proj" in tensors:
            gate_up_EFH = tensors.pop("mlp.experts.gate_up_proj")
            down_EHF = tensors.pop("mlp.experts.down_proj")
            for expert in range(gate_up_EFH.shape[0]):
                out[prefix + _EXPERT.format(expert, 1)] = gate_up_EFH[expert]
                out[prefix + _EXPERT.format(expert, 2)] = down_EHF[expert]
        experts = sorted({int(m.group(1)) for s in tensors if (m := _HF_EXPERT.fullmatch(s))})
        for expert in experts:
            e = f"mlp.experts.{expert}."
            pair = _pop_pair(tensors, e + "gate_proj.weight", e + "up_proj.weight", index)
            if pair is not None:
                out[prefix + _EXPERT.format(expert, 1)] = pair
            if e + "down_proj.weight" in tensors:
                out[prefix + _EXPERT.format(expert, 2)] = tensors.pop(e + "down_proj.weight")
        if (not partial and hf["mlp_layer_types"][index] == "sparse"
                and "mlp.gate.e_score_correction_bias" not in tensors):
            raise ValueError(f"HF weights lack 'model.layers.{index}.mlp.gate.e_score_correction_bias'")
        for suffix, tensor in tensors.items():
            if suffix not in renames:
                raise ValueError(f"unexpected HF weight 'model.layers.{index}.{suffix}'")
            out[prefix + renames[suffix]] = tensor
    return out


def mcore_to_hf(mcore_state: dict[str, torch.Tensor], hf: dict, *,
                checkpoint_layout: bool = False) -> dict[str, torch.Tensor]:
    """Full Megatron weights (global expert numbers) -> HF weights; inverse of ``hf_to_mcore``.

    By default routed experts are stacked as transformers' modules hold them (every expert of a
    layer must be given). ``checkpoint_layout=True`` gives the names HF checkpoint files hold:
    one ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert and no tied ``lm_head``; it
    works on any subset of Megatron weights (streaming).
    """
    hf = normalize_hf_config(hf)
    renames = {mc: hf_name for hf_name, mc in _LAYER_RENAMES}
    fused = {mc: (gate, up) for gate, up, mc in _GATE_UP}
    experts: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
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
            if expert := re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", suffix):
                number, fc = int(expert.group(1)), int(expert.group(2))
                if not checkpoint_layout:
                    experts.setdefault((prefix, fc), {})[number] = tensor
                elif fc == 1:
                    gate, up = torch.chunk(tensor, 2, dim=0)
                    out[prefix + f"mlp.experts.{number}.gate_proj.weight"] = gate
                    out[prefix + f"mlp.experts.{number}.up_proj.weight"] = up
                else:
                    out[prefix + f"mlp.experts.{number}.down_proj.weight"] = tensor
            elif suffix in fused:
                gate, up = torch.chunk(tensor, 2, dim=0)
                out[prefix + fused[suffix][0]], out[prefix + fused[suffix][1]] = gate, up
            elif suffix in renames:
                out[prefix + renames[suffix]] = tensor
            else:
                raise ValueError(f"unexpected Megatron weight {name!r}")
        else:
            raise ValueError(f"unexpected Megatron weight {name!r}")
    for (prefix, fc), by_expert in experts.items():
        if sorted(by_expert) != list(range(hf["n_routed_experts"])):
            raise ValueError(f"{prefix}: expected experts 0..{hf['n_routed_experts'] - 1}, "
                             f"got {sorted(by_expert)[:8]}")
        stacked = torch.stack([by_expert[e] for e in range(len(by_expert))])
        out[prefix + ("mlp.experts.gate_up_proj" if fc == 1 else "mlp.experts.down_proj")] = stacked
    tied = get(hf, "tie_word_embeddings", False)
    if tied and not checkpoint_layout and "model.embed_tokens.weight" in out:
        out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return {k: v.contiguous() for k, v in out.items()}


def tp_sections(name: str, config: TransformerConfig) -> list[int] | None:
    """Full-size sections of fused tensors that TP splits section by section."""
    if name.endswith("shared_experts.linear_fc1.weight"):
        return [config.moe_shared_expert_intermediate_size] * 2
    if re.search(r"experts\.local_experts\.\d+\.linear_fc1\.weight$", name):
        return [config.moe_ffn_hidden_size] * 2
    if name.endswith("mlp.linear_fc1.weight"):
        return [config.ffn_hidden_size] * 2
    return None
