"""What GLM-5 costs: FLOPs (for MFU) and the budget planner's profile (``models/profile.py``)."""

from megatron_longstraw.models.flops import active_linear_weight_elements, linear_flops, logits_flops
from megatron_longstraw.models.glm5.config import normalize_hf_config
from megatron_longstraw.models.hf_config import get
from megatron_longstraw.models.profile import (LayerProfile, ModelProfile, moe_capture_transient_bytes, profile_name,
                                               replay_output_bytes, rms_norm_saved_bytes, routed_experts_saved_bytes,
                                               swiglu_mlp_saved_bytes)

# ---- FLOPs (for MFU)

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


# ---- planning profile
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
    saved = routed_experts_saved_bytes(hidden, experts, topk, ffn)
    if group_topk < groups:                              # group-limited: per-group top-2, group top-k, mask
        saved += 8 * groups * (topk // group_topk) + 8 * group_topk + experts
    return saved + (swiglu_mlp_saved_bytes(hidden, ffn * shared) if shared else 0)


def plan_profile(hf: dict) -> ModelProfile:
    """The budget planner's description of a GLM-5 config (``models/profile.py``), from the raw
    config alone: the parameters ``block_spec`` builds (local spec; duplicated down projections
    and indexer linears, which every TP rank holds whole), the prompt state of ``state.py``,
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
            capture_transient_bytes_per_token=moe_capture_transient_bytes(hidden, per_token) if moe else 0.0,
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
