"""What Qwen3.5 costs: FLOPs (for MFU) and the budget planner's profile (``models/profile.py``)."""

from dataclasses import dataclass

from megatron_longstraw.models.flops import (DELTA_RULE_CHUNK, causal_attention_flops, delta_rule_flops,
                                             linear_flops, linear_weight_elements, logits_flops)
from megatron_longstraw.models.hf_config import get, rope_parameters
from megatron_longstraw.models.profile import (LayerProfile, ModelProfile, profile_name, replay_output_bytes,
                                               rms_norm_saved_bytes, swiglu_mlp_saved_bytes)
from megatron_longstraw.models.qwen3_5.config import normalize_hf_config

# ---- FLOPs (for MFU)

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


# ---- planning profile
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


@dataclass(frozen=True)
class MlpProfile:
    """What a layer's MLP adds to its ``LayerProfile`` (dense here, MoE in ``qwen3_5_moe``)."""

    params: int
    expert_params: int
    """Of ``params``, the routed experts' (sharded over EP)."""
    replicated_params: int
    """Of ``params``, those every TP rank holds whole (a router)."""
    active_params: int
    """Linear weight elements one token passes through."""
    saved_bytes: int
    """Bytes autograd keeps per token."""
    routed_hidden_bytes: int = 0
    """Per token: the routed copies of its hidden state kept between layers."""
    capture_transient_bytes: int = 0
    """Per capture-chunk token: the no-grad working set, where it exceeds the planner's default."""
    num_experts: int = 0
    moe: bool = False


def dense_mlp(hf: dict) -> MlpProfile:
    """A SwiGLU MLP of ``intermediate_size``: ``linear_fc1`` ``[gate; up]`` and ``linear_fc2``."""
    hidden, ffn = hf["hidden_size"], hf["intermediate_size"]
    return MlpProfile(params=3 * ffn * hidden, expert_params=0, replicated_params=0, active_params=3 * ffn * hidden,
                      saved_bytes=swiglu_mlp_saved_bytes(hidden, ffn))


def hybrid_profile(hf: dict, mlp: MlpProfile, tp_divisors: tuple[int, ...]) -> ModelProfile:
    """The budget planner's description of a normalized Qwen3.5-style config whose layers each
    have ``mlp``: the parameters ``block_spec`` builds (local spec), the prompt state of each
    layer kind (``AttentionKVState``, ``GatedDeltaState``), the mixer FLOPs of ``_mixer_flops``
    and the bytes autograd keeps per token (above); ``tp_divisors`` are the MLP's widths TP
    must divide."""
    hidden, vocab = hf["hidden_size"], hf["vocab_size"]
    heads, groups, dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    heads_k, heads_v = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dim_k, dim_v, kernel = hf["linear_key_head_dim"], hf["linear_value_head_dim"], hf["linear_conv_kernel_dim"]
    norms = 2 * hidden                                   # input_layernorm, pre_mlp_layernorm
    mlp_bytes = 2 * rms_norm_saved_bytes(hidden) + mlp.saved_bytes  # + the layer's norms
    hidden_bytes = 2 * rms_norm_saved_bytes(hidden) + 2 * 2 * hidden + mlp.routed_hidden_bytes
    mlp_fields = dict(moe=mlp.moe, expert_params=mlp.expert_params,
                      capture_transient_bytes_per_token=mlp.capture_transient_bytes)

    qkv_rows = (2 * heads + 2 * groups) * dim            # [q, gate, k, v]
    attention_linear = qkv_rows * hidden + hidden * heads * dim
    attention_bias = qkv_rows if get(hf, "attention_bias", False) else 0  # column-parallel: sharded
    attention_norms = norms + 2 * dim                    # + per-head q/k norms
    attention_bytes = _attention_saved_bytes(hf) + mlp_bytes
    attention = LayerProfile(
        mixer="attention", **mlp_fields,
        params=attention_linear + mlp.params + attention_bias + attention_norms,
        replicated_params=attention_norms + mlp.replicated_params,
        active_linear_params=attention_linear + mlp.active_params,
        state_bytes_per_token=2 * 2 * groups * dim, state_bytes_fixed=0,  # bf16 K and V pages
        grad_state_elements_per_token=2 * groups * dim, grad_state_elements_fixed=0,
        tp_sharded_state=True, attention_pair_flops=2.0 * heads * (dim + dim), sparse_topk=0,
        indexer_pair_flops=0.0, delta_rule_flops_per_token=0.0, delta_rule_heads=0,
        replay_activation_bytes_per_token=attention_bytes, sweep_activation_bytes_per_token=attention_bytes,
        replay_hidden_bytes_per_token=hidden_bytes,
    )

    qk, v = heads_k * dim_k, heads_v * dim_v
    conv_channels = 2 * qk + v
    gdn_linear = (2 * qk + 2 * v + 2 * heads_v) * hidden + hidden * v  # in_proj, out_proj
    gdn_other = conv_channels * kernel + 2 * heads_v     # depthwise conv1d (no bias), dt_bias, A_log: sharded
    gdn_norms = norms + dim_v                            # + the gated output norm
    recurrent, tail = heads_v * dim_k * dim_v, conv_channels * (kernel - 1)
    gdn_bytes = _gated_delta_net_saved_bytes(hf) + mlp_bytes
    gated_delta_net = LayerProfile(
        mixer="gated_delta_net", **mlp_fields,
        params=gdn_linear + mlp.params + gdn_other + gdn_norms,
        replicated_params=gdn_norms + mlp.replicated_params,
        active_linear_params=gdn_linear + mlp.active_params,
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
        logits_bytes_per_token=replay_output_bytes(hidden), num_experts=mlp.num_experts,
        tp_divisors=(heads, groups, heads_k, heads_v, vocab) + tp_divisors,  # transformer_config's checks
        sweep_final_norm_bytes_per_token=rms_norm_saved_bytes(hidden),
        last_hidden_state_bytes=2 * hidden, last_hidden_grad_elements=hidden,
        tp_needs_sequence_parallel=mlp.moe,  # Megatron's MoE under TP needs --sequence-parallel
    )


def plan_profile(hf: dict) -> ModelProfile:
    """The budget planner's description of a Qwen3.5 config (``hybrid_profile`` with a dense
    MLP), from the raw config alone. ``ValueError`` for an invalid config."""
    hf = normalize_hf_config(hf)
    return hybrid_profile(hf, dense_mlp(hf), (hf["intermediate_size"],))
