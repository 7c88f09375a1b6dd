"""GLM-5 family (``glm_moe_dsa``): logits, weight mapping, gradients and TP/EP against HF (fp32, CPU)."""

import copy

import pytest
import torch

from megatron_longstraw.models.glm5 import FAMILY as GLM5
from megatron_longstraw.models.builder import build_model, expert_global_name, load_full_state_dict
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.glm5.presets import PRESETS
from megatron_longstraw.testing.hf_reference import build_hf_model, hf_model_class
from megatron_longstraw.testing.multiprocess import run_multiprocess
from megatron_longstraw.testing.parity import max_rel_error

SEQ = 48  # > 5 x index_topk (8): DSA drops most keys of late queries


def _debug_config(**overrides) -> dict:
    hf = copy.deepcopy(PRESETS["glm-5-debug"])
    hf.update(overrides)
    return hf


def _tokens(batch=2, seq=SEQ, seed=0):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _megatron_from_hf(hf, hf_model, options=ModelOptions()):
    model = build_model(hf, options, parallel_output=False)
    load_full_state_dict(model, GLM5.weights.hf_to_mcore(hf_model.state_dict(), hf))
    return model.eval()


def _logits(model, tokens):
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(tokens, position_ids, attention_mask=None)


def _hf_topk_per_layer(hf_model, tokens) -> dict[int, torch.Tensor]:
    """Run HF and record each full layer's indexer top-k indices ``[B, S, topk]``."""
    found = {}
    hooks = [layer.self_attn.indexer.register_forward_hook(
        lambda mod, args, out, i=i: found.__setitem__(i, out))
        for i, layer in enumerate(hf_model.model.layers) if layer.self_attn.indexer is not None]
    try:
        with torch.no_grad():
            logits = hf_model(tokens).logits
    finally:
        for hook in hooks:
            hook.remove()
    return found, logits


def test_debug_preset_exercises_every_feature():
    hf = _debug_config()
    assert {"full", "shared"} == set(hf["indexer_types"])
    assert {"dense", "sparse"} == set(hf["mlp_layer_types"])
    assert hf["num_experts_per_tok"] >= 2 and 1 < hf["topk_group"] < hf["n_group"]
    assert hf["index_topk"] < SEQ // 4


def test_logits_match_hf(single_process):
    """Dense + MoE layers, full + shared indexer layers, group-limited routing, sparse DSA."""
    hf = _debug_config()
    hf_model = build_hf_model(hf, seed=1)
    tokens = _tokens()
    topk, expected = _hf_topk_per_layer(hf_model, tokens)
    # DSA really drops keys: late queries attend to index_topk of their SEQ causal keys
    assert sorted(topk) == [i for i, t in enumerate(hf["indexer_types"]) if t == "full"]
    for indices in topk.values():
        assert indices.shape == (2, SEQ, hf["index_topk"])
    assert not torch.equal(topk[0], topk[1])  # the layers pick different keys
    model = _megatron_from_hf(hf, hf_model)
    with torch.no_grad():
        actual = _logits(model, tokens)
    diff = (actual - expected).abs().max().item()
    print(f"GLM-5 debug: max abs logit diff vs HF {diff:.3e}")
    assert diff <= 1e-4, f"max abs logit diff {diff}"
    assert expected.abs().max().item() > 1e-1  # not a comparison of near-zero logits
    # the sparsity matters: with top-k >= SEQ (dense attention) the logits move far away
    dense = _megatron_from_hf(_debug_config(index_topk=SEQ), hf_model)
    with torch.no_grad():
        assert (_logits(dense, tokens) - expected).abs().max().item() > 1e-3


def test_routing_uses_several_experts_and_groups(single_process):
    """The HF router picks >= 2 experts per token, and group limiting changes the choice."""
    hf = _debug_config()
    hf_model = build_hf_model(hf, seed=1)
    router = hf_model.model.layers[1].mlp.gate
    hidden = torch.randn(64, hf["hidden_size"], generator=torch.Generator().manual_seed(3))
    _, weights, indices = router(hidden)
    assert indices.shape == (64, hf["num_experts_per_tok"]) and (weights > 0).all()
    assert indices.unique().numel() > hf["num_experts_per_tok"]
    router.topk_group = router.num_group
    _, _, ungrouped = router(hidden)
    assert not torch.equal(indices.sort(-1).values, ungrouped.sort(-1).values)


def test_weight_mapping_round_trip_is_bit_identical():
    hf = _debug_config()
    hf_state = build_hf_model(hf, seed=2).state_dict()
    back = GLM5.weights.mcore_to_hf(GLM5.weights.hf_to_mcore(hf_state, hf), hf)
    assert sorted(back) == sorted(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(back[name], tensor), name


def test_mtp_weights_are_dropped_with_a_warning():
    hf = _debug_config()
    hf_state = dict(build_hf_model(hf, seed=2).state_dict())
    hf_state["model.layers.4.eh_proj.weight"] = torch.zeros(4, 4)
    with pytest.warns(UserWarning, match="MTP"):
        full = GLM5.weights.hf_to_mcore(hf_state, hf)
    assert not any(".layers.4." in name for name in full)


def test_forward_backward_reaches_every_trained_parameter(single_process):
    """Loss gradients reach every parameter except the DSA indexers (HF and Megatron run the
    indexer without grad; it is trained only by the optional indexer KL loss)."""
    hf = _debug_config()
    model = build_model(hf, ModelOptions())
    model.train()
    tokens = _tokens(batch=1, seq=40)
    logits = _logits(model, tokens)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    for name, param in model.named_parameters():
        if ".core_attention.indexer." in name:
            assert param.grad is None or not param.grad.any(), name
            continue
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"zero gradient for {name}"


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("field", ["q_lora_rank", "kv_lora_rank", "index_topk", "n_routed_experts"])
def test_missing_field_is_named(single_process, field):
    hf = _debug_config()
    del hf[field]
    with pytest.raises(ValueError, match=f"missing field '{field}'"):
        build_model(hf, ModelOptions())


def test_bad_indexer_pattern_is_refused(single_process):
    with pytest.raises(ValueError, match="indexer_types"):
        build_model(_debug_config(indexer_types=["full", "shared", "full", "shared"][:3]), ModelOptions())
    with pytest.raises(ValueError, match="periodic"):
        build_model(_debug_config(indexer_types=["full", "shared", "full", "full"]), ModelOptions())
    with pytest.raises(ValueError, match=r"indexer_types\[0\]"):
        build_model(_debug_config(indexer_types=["shared", "full", "full", "full"]), ModelOptions())


def test_unsupported_routing_is_refused(single_process):
    with pytest.raises(ValueError, match="norm_topk_prob"):
        build_model(_debug_config(norm_topk_prob=False), ModelOptions())
    with pytest.raises(ValueError, match="top-2"):
        build_model(_debug_config(num_experts_per_tok=2), ModelOptions())


def _config_errors(cases):
    """On each rank: the ValueError text of ``transformer_config`` for each (hf, tp, ep, sp)."""
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed

    errors = []
    for hf, tp, ep, sequence_parallel in cases:
        init_distributed(ParallelSizes(tensor=tp, expert=ep))
        try:
            GLM5.transformer_config(hf, ModelOptions(sequence_parallel=sequence_parallel))
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_heads_and_experts_not_divisible_are_refused():
    cases = [
        (_debug_config(num_attention_heads=3, num_key_value_heads=3), 2, 1, True),
        (_debug_config(n_routed_experts=15), 1, 2, False),
        (_debug_config(), 2, 1, False),
    ]
    heads, experts, no_sp = run_multiprocess(_config_errors, 2, cases)[0]
    assert heads == "num_attention_heads (3) is not divisible by --tensor-model-parallel-size 2"
    assert experts == "n_routed_experts (15) is not divisible by --expert-model-parallel-size 2"
    assert "--sequence-parallel" in no_sp


# ----------------------------------------------------------------------------- TP / EP


def _parallel_logits(hf, tp, ep):
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed

    init_distributed(ParallelSizes(tensor=tp, expert=ep), seed=5)
    hf_model = build_hf_model(hf, seed=1)
    model = _megatron_from_hf(hf, hf_model, ModelOptions(sequence_parallel=tp > 1))
    with torch.no_grad():
        return _logits(model, _tokens())


def _fp64_grads(hf, tp):
    """fp64 next-token-loss gradients after Megatron's TP reductions (None grads left out)."""
    from megatron_longstraw.testing.parity import reduce_tp_grads

    hf_model = build_hf_model(hf, seed=1).to(torch.float64)
    options = ModelOptions(params_dtype=torch.float64, sequence_parallel=tp > 1)
    model = _megatron_from_hf(hf, hf_model, options)
    tokens = _tokens(batch=1)
    logits = _logits(model, tokens)
    torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:]).backward()
    reduce_tp_grads(model)
    return model, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _tp_worker(hf, reference_grads):
    from megatron_longstraw.testing.parity import tp_grad_errors

    logits = _parallel_logits(hf, 2, 1)
    model, grads = _fp64_grads(hf, 2)
    assert sorted(grads) == sorted(reference_grads)
    return logits, max(tp_grad_errors(model, grads, reference_grads).values())


def test_tensor_parallel_2_matches_tp_1(single_process):
    """TP=2 (sequence parallel) logits (fp32) and gradients (fp64) equal TP=1's."""
    hf = _debug_config()
    reference = _parallel_logits(hf, 1, 1)
    _, reference_grads = _fp64_grads(hf, 1)
    for logits, worst_grad in run_multiprocess(_tp_worker, 2, hf, reference_grads):
        diff = (logits - reference).abs().max().item()
        print(f"GLM-5 debug: TP=2 vs TP=1 max abs logit diff {diff:.3e}, "
              f"worst relative grad diff {worst_grad:.3e}")
        assert diff <= 1e-5, diff
        assert worst_grad <= 1e-5, worst_grad


def _replay_logits_and_grads(hf):
    """LongStraw on the current parallel state: replay logits (fp32) of one response after a
    chunked capture, and the fp64 replay gradients of two responses by global parameter name
    (a routed expert's local index on its EP rank mapped back to its global one)."""
    from megatron.core import parallel_state

    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.replay import replay_logits, replay_responses

    prompt, responses = _tokens(1, 40, seed=3), [_tokens(1, n, seed=10 + n)[0] for n in (9, 6)]
    model = _megatron_from_hf(hf, build_hf_model(hf, seed=1))
    with torch.no_grad():
        logits = replay_logits(model, capture_prompt(model, prompt, 16), responses[0][None])[:, 0]
    model = _megatron_from_hf(hf, build_hf_model(hf, seed=1).double(), ModelOptions(params_dtype=torch.float64))
    with torch.no_grad():
        state = capture_prompt(model, prompt, 16)
    replay_responses(model, state, responses, lambda lp, mask, idx: -(lp * mask).sum() / 15, micro_batch_size=1)
    per_rank = model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * per_rank

    # Megatron's DDP scales an expert's gradient by 1 / (DP x CP) and sums it over the expert's
    # data-parallel group (size 1 here); every rank's tokens reach the expert, so without that
    # scaling its gradient is DP x CP times EP=1's
    expert_scale = 1.0 / parallel_state.get_data_parallel_world_size(with_context_parallel=True)

    return logits, {expert_global_name(n, first): p.grad * (expert_scale if ".local_experts." in n else 1.0)
                    for n, p in model.named_parameters() if p.grad is not None}


def _ep_worker(hf):
    return _parallel_logits(hf, 1, 2), *_replay_logits_and_grads(hf)


def test_expert_parallel_2_matches_ep_1(single_process):
    """EP=2 (all-to-all dispatcher, both ranks on the same tokens): the full forward's logits, and
    LongStraw's replay logits and gradients (every rank's dense ones, each expert's on its owner)
    equal EP=1's."""
    hf = _debug_config()
    reference = _parallel_logits(hf, 1, 1)
    ref_replay, ref_grads = _replay_logits_and_grads(hf)
    results = run_multiprocess(_ep_worker, 2, hf)
    experts = set()
    for logits, replay, grads in results:
        diff = (logits - reference).abs().max().item()
        print(f"GLM-5 debug: EP=2 vs EP=1 max abs logit diff {diff:.3e}")
        assert diff <= 1e-5, diff
        assert (replay - ref_replay).abs().max().item() <= 1e-5
        assert set(grads) <= set(ref_grads)
        for name, grad in grads.items():
            assert max_rel_error(grad, ref_grads[name]) <= 1e-10, name
        experts |= {n for n in grads if ".local_experts." in n}
    assert experts == {n for n in ref_grads if ".local_experts." in n}  # every expert on one rank


LOCKSTEP_PROMPTS = (40, 18)  # tokens per rank: 3 and 2 capture chunks of 16
LOCKSTEP_NEW_TOKENS = (2, 5)  # decode steps per rank (the first rank stops first)


def _capture_and_decode(hf, prompt_length, new_tokens):
    """Capture a prompt (chunks of 16) and decode two greedy samples from it on the current
    parallel state: (last prompt logits, responses, log-probs, idle passes run in each phase)."""
    from megatron_longstraw.longstraw import expert_lockstep
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.rollout.generate import generate_from_state

    idle = []
    run_idle = expert_lockstep.ExpertLockstep.idle_pass
    expert_lockstep.ExpertLockstep.idle_pass = lambda self: (idle.append(1), run_idle(self))
    try:
        model = _megatron_from_hf(hf, build_hf_model(hf, seed=1))
        with torch.no_grad():
            state = capture_prompt(model, _tokens(1, prompt_length, seed=prompt_length), 16)
        captured = len(idle)
        rollouts = generate_from_state(model, state, 2, new_tokens, temperature=0.0)
    finally:
        expert_lockstep.ExpertLockstep.idle_pass = run_idle
    return state.last_logits_BV, rollouts.responses, rollouts.logprobs, (captured, len(idle) - captured)


def _lockstep_worker(hf):
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed

    init_distributed(ParallelSizes(expert=2), seed=5)
    rank = torch.distributed.get_rank()
    return _capture_and_decode(hf, LOCKSTEP_PROMPTS[rank], LOCKSTEP_NEW_TOKENS[rank])


def test_expert_parallel_over_data_ranks_runs_in_lockstep(single_process):
    """EP=2 over two data-parallel ranks, each with a prompt and a decode length of its own: the
    rank with fewer capture chunks (and the one that stops decoding first) runs idle MoE passes
    until the other is done (``expert_lockstep``), and each rank's logits and greedy samples equal
    a single process's on its own prompt. Without the lockstep the ranks' all-to-alls do not
    match: the rank that finishes first leaves, and the other's all-to-all fails (or hangs)."""
    hf = _debug_config()
    results = run_multiprocess(_lockstep_worker, 2, hf, timeout=240)
    for rank, (logits, responses, logprobs, idle) in enumerate(results):
        ref_logits, ref_responses, ref_logprobs, ref_idle = _capture_and_decode(
            hf, LOCKSTEP_PROMPTS[rank], LOCKSTEP_NEW_TOKENS[rank])
        assert ref_idle == (0, 0)
        assert (logits - ref_logits).abs().max().item() <= 1e-5, rank
        assert [r.tolist() for r in responses] == [r.tolist() for r in ref_responses], rank
        for a, b in zip(logprobs, ref_logprobs, strict=True):
            assert (a - b).abs().max().item() <= 1e-5, rank
    # rank 1 captures 2 chunks against rank 0's 3; rank 0 decodes 1 step against rank 1's 4
    # (the first token comes from the capture's logits)
    assert results[0][3] == (0, 3) and results[1][3] == (1, 0), [r[3] for r in results]


def test_hf_reference_class_is_glm_moe_dsa():
    model_cls, config_cls = hf_model_class("glm_moe_dsa")
    assert model_cls.__name__ == "GlmMoeDsaForCausalLM" and config_cls.model_type == "glm_moe_dsa"


def test_cpu_moe_alltoall_patch_is_what_makes_the_dispatcher_run(single_process):
    """Without ``cpu_moe_alltoall`` the all-to-all dispatcher cannot even be built on the CPU;
    with it, the split sizes end up as host numpy arrays exactly as the CUDA path leaves them."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only patch")
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_longstraw.patches import cpu_moe_alltoall

    config = GLM5.transformer_config(_debug_config(), ModelOptions())
    config.moe_token_dispatcher_type = "alltoall"
    experts = config.num_moe_experts

    def make():
        return MoEAlltoAllTokenDispatcher(experts, list(range(experts)), config=config,
                                          pg_collection=get_default_pg_collection())

    cpu_moe_alltoall.revert()
    try:
        with pytest.raises((RuntimeError, AssertionError)):  # no CUDA stream on this machine
            make()
    finally:
        cpu_moe_alltoall.apply()
    dispatcher = make()
    dispatcher.input_splits = torch.tensor([3])
    out = dispatcher._maybe_dtoh_and_synchronize(dispatcher.cuda_dtoh_point, torch.tensor([1, 2]))
    assert out.tolist() == [1, 2] and dispatcher.input_splits.tolist() == [3]
    assert not torch.is_tensor(dispatcher.input_splits)
