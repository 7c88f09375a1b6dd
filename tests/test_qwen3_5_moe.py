"""Qwen3.5-MoE family (HF ``qwen3_5_moe``): logits and weights against transformers'
``Qwen3_5MoeForCausalLM`` (fp32), the weight round trip in both expert layouts, and capture,
replay, decoding and the exact prompt gradient against the full graph (CPU)."""

import copy

import pytest
import torch

from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.replay import replay_logits
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.qwen3_5_moe import FAMILY
from megatron_longstraw.models.qwen3_5_moe.presets import PRESETS
from megatron_longstraw.models.registry import family_for
from megatron_longstraw.testing.hf_reference import build_hf_model
from megatron_longstraw.testing.parity import (assert_exact_equals_full_backprop, forward_logits, max_rel_error,
                                               megatron_from_hf, weighted_response_loss)

PROMPT = 30


def _debug(**overrides) -> dict:
    hf = copy.deepcopy(PRESETS["qwen3.5-moe-debug"])
    hf.update(overrides)
    return hf


def _tokens(hf, n, seed, batch=1):
    return torch.randint(0, hf["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(seed))


def test_family_serves_the_moe_model_types():
    assert family_for("qwen3_5_moe") is FAMILY and family_for("qwen3_5_moe_text") is FAMILY
    for name in ("qwen3.5-35b-a3b", "qwen3.6-35b-a3b"):  # the published text model: 35B total, 3B active
        profile = FAMILY.plan_profile(PRESETS[name])
        total = profile.embedding_params + profile.output_params + sum(layer.params for layer in profile.layers)
        active = sum(layer.active_linear_params for layer in profile.layers)
        assert 34e9 < total < 36e9 and 2.5e9 < active + 2 * 248_320 * 2048 < 3.5e9, (total, active)


def test_logits_match_hf(single_process):
    """Every layer kind, 70 tokens (> one Gated DeltaNet chunk), two sequences; each token routes
    to 2 of 8 experts."""
    hf = _debug()
    hf_model = build_hf_model(hf, seed=1)
    model = megatron_from_hf(hf, hf_model)
    tokens = _tokens(hf, 70, 0, batch=2)
    with torch.no_grad():
        want, got = hf_model(tokens).logits, forward_logits(model, tokens)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    assert want.abs().max().item() > 1e-2


def test_weight_round_trip_is_bit_identical_in_both_expert_layouts():
    hf = _debug()
    module_state = build_hf_model(hf, seed=2).state_dict()  # stacked experts, as the official checkpoints
    mcore = FAMILY.weights.hf_to_mcore(module_state, hf)
    assert any(".mlp.shared_experts.gate_weight" in n for n in mcore)
    back = FAMILY.weights.mcore_to_hf(mcore, hf)
    assert sorted(back) == sorted(module_state)
    for name, tensor in module_state.items():
        assert torch.equal(back[name], tensor), name
    # an export writes the official checkpoints' stacked layout too
    assert sorted(FAMILY.weights.mcore_to_hf(mcore, hf, checkpoint_layout=True)) == sorted(module_state)
    # one tensor per expert (some quantized exports) reads to the same weights
    per_expert = {n: t for n, t in module_state.items() if ".mlp.experts." not in n}
    for layer in range(hf["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts."
        stacked = zip(module_state[prefix + "gate_up_proj"], module_state[prefix + "down_proj"])
        for e, (gate_up, down) in enumerate(stacked):
            gate, up = gate_up.chunk(2)
            per_expert.update({f"{prefix}{e}.gate_proj.weight": gate, f"{prefix}{e}.up_proj.weight": up,
                               f"{prefix}{e}.down_proj.weight": down})
    again = FAMILY.weights.hf_to_mcore(per_expert, hf)
    assert sorted(again) == sorted(mcore) and all(torch.equal(again[n], mcore[n]) for n in mcore)


@pytest.mark.parametrize("chunk", [7])
def test_capture_replay_and_decoding_equal_the_full_forward(single_process, chunk):
    from megatron_longstraw.rollout.generate import generate_from_state

    hf = _debug()
    model = megatron_from_hf(hf, build_hf_model(hf, seed=3))
    prompt, response = _tokens(hf, PROMPT, 1), _tokens(hf, 9, 2)
    with torch.no_grad():
        full = forward_logits(model, torch.cat([prompt, response], 1))[0, PROMPT - 1:-1]
        state = capture_prompt(model, prompt, chunk)
        replayed = replay_logits(model, state, response)[:, 0]
        assert (replayed - full).abs().max().item() <= 1e-5
        out = generate_from_state(model, state, num_samples=1, max_new_tokens=5, temperature=0.0, keep_logits=True)
        want = forward_logits(model, torch.cat([prompt, out.responses[0].view(1, -1)], 1))[0, PROMPT - 1:-1]
    assert (out.step_logits[0] - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("chunk, lengths, micro_batch", [(7, (13, 1, 7), 3)])  # a chunk that does not divide
def test_exact_gradients_equal_full_backprop(single_process, chunk, lengths, micro_batch):
    """Every parameter's ``--prompt-gradient exact`` gradient equals full backprop through prompt
    + responses with nothing detached, to 1e-9 relative (fp64)."""
    hf = _debug()
    model = megatron_from_hf(hf, build_hf_model(hf, seed=0).to(torch.float64), ModelOptions(params_dtype=torch.float64))
    prompt = _tokens(hf, PROMPT, 3)
    responses = [_tokens(hf, n, 10 + n)[0] for n in lengths]
    loss_fn = weighted_response_loss(sum(lengths))
    assert_exact_equals_full_backprop(model, prompt, responses, loss_fn, chunk, micro_batch)


def test_bad_configs_are_one_line_naming_the_field(single_process, monkeypatch):
    from megatron_longstraw.models.builder import build_model

    for bad, message in (({"num_experts_per_tok": 9}, "num_experts_per_tok \\(9\\) must be between 1 and "
                                                       "num_experts \\(8\\)"),
                         ({"mlp_only_layers": [0]}, "mlp_only_layers \\[0\\] is not supported"),
                         ({"num_experts": None}, "missing field 'num_experts'")):
        with pytest.raises(ValueError, match=message):
            build_model(_debug(**bad), ModelOptions())
    kwargs = ModelOptions().config_kwargs()
    monkeypatch.setattr(ModelOptions, "config_kwargs", lambda self: dict(kwargs, expert_model_parallel_size=3))
    with pytest.raises(ValueError, match="num_experts \\(8\\) is not divisible by --expert-model-parallel-size 3"):
        FAMILY.transformer_config(FAMILY.normalize_hf_config(_debug()), ModelOptions())


# ----------------------------------------------------------------------------- TP / EP

def _parallel_run(hf, prompt, responses):
    """On the current parallel state: the full forward's logits (fp32), LongStraw's replay logits
    of the first response (fp32) and the fp64 replay gradients of all by global parameter name
    (a routed expert's local index mapped to its global one, Megatron's DDP scaling of an
    expert's gradient by 1 / DP undone)."""
    from megatron.core import parallel_state

    from megatron_longstraw.longstraw.replay import replay_responses
    from megatron_longstraw.models.builder import expert_global_name

    sp = parallel_state.get_tensor_model_parallel_world_size() > 1
    model = megatron_from_hf(hf, build_hf_model(hf, seed=1), ModelOptions(sequence_parallel=sp))
    with torch.no_grad():
        full = forward_logits(model, torch.cat([prompt, responses[0][None]], 1))
        replayed = replay_logits(model, capture_prompt(model, prompt, 16), responses[0][None])[:, 0]
    model = megatron_from_hf(hf, build_hf_model(hf, seed=1).double(),
                             ModelOptions(params_dtype=torch.float64, sequence_parallel=sp), parallel_output=True)
    with torch.no_grad():
        state = capture_prompt(model, prompt, 16)
    replay_responses(model, state, responses, lambda lp, mask, idx: -(lp * mask).sum() / 15, micro_batch_size=1)
    if sp:
        from megatron_longstraw.testing.parity import reduce_tp_grads
        reduce_tp_grads(model)
    ep = parallel_state.get_expert_model_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * (model.config.num_moe_experts or 0) // ep
    scale = 1.0 / parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    grads = {expert_global_name(n, first): p.grad * (scale if ".local_experts." in n else 1.0)
             for n, p in model.named_parameters() if p.grad is not None}
    if tp > 1:  # this rank's shards against one rank's: the errors, computed here
        return full, replayed, model, grads
    return full, replayed, grads


def _inputs(hf):
    return _tokens(hf, 40, 3), [_tokens(hf, n, 10 + n)[0] for n in (8, 7)]  # (SP: 48 tokens in the full forward)


def _worker(hf, reference_grads):
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import destroy_distributed, init_distributed
    from megatron_longstraw.testing.multiprocess import use_port
    from megatron_longstraw.testing.parity import tp_grad_errors

    torch.set_num_threads(1)
    out = {}
    for port, sizes in enumerate((ParallelSizes(tensor=2), ParallelSizes(expert=2))):
        use_port(port)
        init_distributed(sizes, seed=5)
        try:
            if sizes.tensor > 1:
                full, replayed, model, grads = _parallel_run(hf, *_inputs(hf))
                errors = tp_grad_errors(model, grads, reference_grads, 1e-30)
                out["tp"] = full, replayed, max(errors.values()), max(errors, key=errors.get)
            else:
                full, replayed, grads = _parallel_run(hf, *_inputs(hf))
                out["ep"] = full, replayed, {n: max_rel_error(g, reference_grads[n]) for n, g in grads.items()}
        finally:
            destroy_distributed()
    return out


def test_tensor_and_expert_parallel_2_match_one_rank(single_process):
    """TP=2 (sequence parallel) and EP=2 (all-to-all dispatcher, both ranks on the same tokens):
    the full forward's and LongStraw's replay logits (fp32, 1e-5) and replay gradients (fp64,
    after Megatron's TP reductions; each expert's on its owner) equal one rank's."""
    from megatron_longstraw.testing.multiprocess import run_multiprocess

    hf = _debug()
    ref_full, ref_replay, ref_grads = _parallel_run(hf, *_inputs(hf))
    experts = set()
    for out in run_multiprocess(_worker, 2, hf, ref_grads, timeout=300):
        for layout in ("tp", "ep"):
            full, replayed = out[layout][:2]
            assert (full - ref_full).abs().max().item() <= 1e-5, layout
            assert (replayed - ref_replay).abs().max().item() <= 1e-5, layout
        assert out["tp"][2] <= 1e-9, out["tp"][3]
        errors = out["ep"][2]
        assert max(errors.values()) <= 1e-10, max(errors, key=errors.get)
        experts |= {n for n in errors if ".local_experts." in n}
    assert experts == {n for n in ref_grads if ".local_experts." in n}  # every expert on one rank
