"""Capture + replay against the full graph (fp32 logits; fp64 gradients), the state's contents."""

import pytest
import torch

from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.full_graph import full_graph_responses
from megatron_longstraw.longstraw.replay import replay_logits, replay_responses
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.hf_reference import build_hf_model
from megatron_longstraw.testing.parity import forward_logits, max_rel_error, megatron_from_hf

PROMPT, RESPONSE = 45, 13
# the GPU path's kernel interface in plain torch, the prompt in blocks of 5 keys
KERNELS = {"math": KernelOptions(), "emulated": KernelOptions(attention_backend="emulated", prefix_block=5)}


def _model(preset, dtype=torch.float32, seed=0, kernels=KernelOptions()):
    hf = resolve_hf_config(preset)
    return hf, megatron_from_hf(hf, build_hf_model(hf, seed=seed).to(dtype),
                                ModelOptions(params_dtype=dtype, kernel_options=kernels))


def _tokens(hf, n, seed):
    return torch.randint(0, hf["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
@pytest.mark.parametrize("chunk", [15, 16, 1, 64])
def test_replay_logits_equal_full_forward(single_process, preset, chunk):
    """Chunks that divide the prompt (15), do not (16), a 1-token chunk, and one chunk (64)."""
    hf, model = _model(preset)
    prompt, response = _tokens(hf, PROMPT, 1), _tokens(hf, RESPONSE, 2)
    with torch.no_grad():
        full = forward_logits(model, torch.cat([prompt, response], 1))[0, PROMPT - 1:-1]
        state = capture_prompt(model, prompt, chunk)
        replayed = replay_logits(model, state, response)[:, 0]
    diff = (replayed - full).abs().max().item()
    assert diff <= 1e-5, f"max abs logit diff {diff}"
    assert (state.last_logits_BV[0] - full[0]).abs().max().item() <= 1e-5


def _nll(total_tokens):
    def loss_fn(logprobs_RB, mask_RB, indices):
        return -(logprobs_RB * mask_RB).sum() / total_tokens
    return loss_fn


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("preset,attention", [("qwen3.5-debug", "math"), ("glm-5-debug", "math"),
                                              ("qwen3.5-debug", "emulated")])
def test_replay_gradients_equal_stop_gradient_full_graph(single_process, preset, attention):
    """fp64: some random-model gradients are too small for fp32 to resolve 1e-5 (see parity.py).
    ``emulated``: the GPU path's fold/block/merge orchestration (kernels emulated), 5-key blocks."""
    hf, model = _model(preset, torch.float64, kernels=KERNELS[attention])
    prompt = _tokens(hf, PROMPT, 3)
    responses = [_tokens(hf, n, 10 + n)[0] for n in (RESPONSE, 7, 11)]
    loss_fn = _nll(sum(r.numel() for r in responses))
    full_graph_responses(model, prompt, responses, loss_fn, micro_batch_size=1)
    reference = _grads(model)
    with torch.no_grad():
        state = capture_prompt(model, prompt, 16)
    replay_responses(model, state, responses, loss_fn, micro_batch_size=1)
    replayed = _grads(model)
    assert set(replayed) == set(reference)
    for name, ref in reference.items():
        rel = max_rel_error(replayed[name], ref)
        assert rel <= 1e-5, f"{name}: relative gradient error {rel}"
        assert ref.abs().max() > 0, f"{name}: zero reference gradient"


@pytest.mark.parametrize("preset,attention", [("qwen3.5-debug", "math"), ("glm-5-debug", "math"),
                                              ("qwen3.5-debug", "emulated")])
def test_one_by_one_equals_one_micro_batch(single_process, preset, attention):
    """``emulated``: the GPU path, whose prefix part folds the micro-batch's samples together."""
    hf, model = _model(preset, torch.float64, kernels=KERNELS[attention])
    prompt = _tokens(hf, PROMPT, 4)
    responses = [_tokens(hf, n, 20 + n)[0] for n in (9, 13, 5, 13)]
    loss_fn = _nll(sum(r.numel() for r in responses))
    with torch.no_grad():
        state = capture_prompt(model, prompt, 8)
    replay_responses(model, state, responses, loss_fn, micro_batch_size=1)
    serial = _grads(model)
    replay_responses(model, state, responses, loss_fn, micro_batch_size=4)
    batched = _grads(model)
    for name, ref in serial.items():
        assert torch.allclose(batched[name], ref, rtol=1e-10, atol=1e-14), name


def _dsa_topk_holder(model):
    """Megatron's per-forward DSA top-k holder (source layer number -> ``[b, s, topk]``)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    return getattr(model.config, DSAttention._HOLDER_ATTR)


def test_glm_replay_top_k_ranks_prompt_and_response_keys(single_process):
    """Long enough that DSA drops most keys of response queries: replay's selection over
    [prompt indexer keys; response indexer keys] is the full forward's, and it mixes both."""
    hf, model = _model("glm-5-debug")
    prompt_length, response_length, topk = 96, 40, hf["index_topk"]
    prompt, response = _tokens(hf, prompt_length, 5), _tokens(hf, response_length, 6)
    with torch.no_grad():
        full = forward_logits(model, torch.cat([prompt, response], 1))[0, prompt_length - 1:-1]
        full_topk = {layer: t[:, prompt_length:].clone() for layer, t in _dsa_topk_holder(model).items()}
        state = capture_prompt(model, prompt, 32)
        replayed = replay_logits(model, state, response)[:, 0]
        replay_topk = dict(_dsa_topk_holder(model))
    assert (replayed - full).abs().max().item() <= 1e-5
    full_layers = [i + 1 for i, t in enumerate(hf["indexer_types"]) if t == "full"]
    assert sorted(replay_topk) == sorted(full_topk) == full_layers
    for layer in full_layers:
        selected = replay_topk[layer][0]  # [response, topk]
        assert selected.shape == (response_length, topk)
        assert torch.equal(selected.sort(-1).values, full_topk[layer][0].sort(-1).values)
        visible = prompt_length + 1 + torch.arange(response_length)[:, None]
        assert ((selected >= 0) & (selected < visible)).all()  # causal, every slot used
        assert (visible > 4 * topk).all()  # most visible keys are dropped
        assert (selected < prompt_length).any() and (selected >= prompt_length).any()
        mixed_rows = ((selected < prompt_length).any(-1) & (selected >= prompt_length).any(-1))
        assert mixed_rows.sum() >= response_length // 4


def test_glm_prompt_state_holds_latents_and_indexer_keys_only(single_process):
    """Bytes = P x e x (layers x (kv_lora_rank + qk_rope_head_dim) + indexer layers x
    index_head_dim) + the last hidden state; shared-indexer layers keep no indexer keys."""
    from megatron_longstraw.models.glm5.state import IndexerKeyState, MLALatentState

    hf, model = _model("glm-5-debug")
    prompt_length, element = PROMPT, 4  # fp32
    layers = hf["num_hidden_layers"]
    full_indexers = sum(t == "full" for t in hf["indexer_types"])
    expected = prompt_length * element * (
        layers * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) + full_indexers * hf["index_head_dim"]
    ) + hf["hidden_size"] * element
    with torch.no_grad():
        state = capture_prompt(model, _tokens(hf, prompt_length, 7), 16)
    assert state.nbytes() == expected
    kinds = sorted(type(s).__name__ for s in state.layers.values())
    assert kinds == sorted(["MLALatentState"] * layers + ["IndexerKeyState"] * full_indexers)
    for name, layer_state in state.layers.items():
        assert layer_state.length == prompt_length, name
        if isinstance(layer_state, MLALatentState):
            assert layer_state.c_kv_SBC.shape == (prompt_length, 1, hf["kv_lora_rank"])
            assert layer_state.k_rope_SBR.shape == (prompt_length, 1, hf["qk_rope_head_dim"])
        else:
            assert isinstance(layer_state, IndexerKeyState)
            assert layer_state.key_SBD.shape == (prompt_length, 1, hf["index_head_dim"])
    # the captured latents are the ones a single full forward computes (chunking changes nothing)
    with torch.no_grad():
        whole = capture_prompt(model, _tokens(hf, prompt_length, 7), prompt_length)
    for name, layer_state in state.layers.items():
        for field, tensor in layer_state.tensors().items():
            assert (tensor - whole.layers[name].tensors()[field]).abs().max() <= 1e-6, (name, field)


def test_glm_capture_leaves_moe_routing_statistics_alone(single_process):
    """No-grad capture neither updates ``expert_bias`` nor counts tokens for its update; replay
    (with grad) counts the response tokens only."""
    hf, model = _model("glm-5-debug")
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.router")]
    assert routers and all(r.local_tokens_per_expert is not None for r in routers)
    biases = [r.expert_bias.clone() for r in routers]
    for router in routers:
        router.local_tokens_per_expert.zero_()
    state = capture_prompt(model, _tokens(hf, PROMPT, 8), 16)
    for router, bias in zip(routers, biases):
        assert torch.equal(router.expert_bias, bias)
        assert router.local_tokens_per_expert.sum() == 0
    replay_logits(model, state, _tokens(hf, RESPONSE, 9)).sum().backward()
    for router, bias in zip(routers, biases):
        assert torch.equal(router.expert_bias, bias)
        assert router.local_tokens_per_expert.sum() == RESPONSE * hf["num_experts_per_tok"]


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
def test_activation_recompute_keeps_both_modes_exact(single_process, preset):
    """Recomputed layers re-run forward inside backward; they must see the same binding."""
    hf = resolve_hf_config(preset)
    hf_model = build_hf_model(hf, seed=0).to(torch.float64)
    prompt = _tokens(hf, PROMPT, 5)
    responses = [_tokens(hf, n, 30 + n)[0] for n in (RESPONSE, 6)]
    loss_fn = _nll(sum(r.numel() for r in responses))
    grads = {}
    for recompute in (None, "full"):
        model = megatron_from_hf(hf, hf_model, ModelOptions(params_dtype=torch.float64,
                                                            recompute_granularity=recompute))
        model.train()
        full_graph_responses(model, prompt, responses, loss_fn)
        grads[recompute, "full"] = _grads(model)
        with torch.no_grad():
            state = capture_prompt(model, prompt, 16)
        replay_responses(model, state, responses, loss_fn)
        grads[recompute, "replay"] = _grads(model)
    for name, ref in grads[None, "full"].items():
        for key in (("full", "full"), (None, "replay"), ("full", "replay")):
            rel = max_rel_error(grads[key][name], ref)
            assert rel <= 1e-5, f"{key} {name}: relative gradient error {rel}"


def test_chunked_response_logprobs_equal_unchunked(single_process):
    from megatron_longstraw.longstraw.model_steps import output_logits, response_logprobs, token_logprobs

    hf, model = _model("qwen3.5-debug", torch.float64)
    hidden = torch.randn(11, 2, hf["hidden_size"], dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, hf["vocab_size"], (11, 2))
    results = []
    for chunked in (False, True):
        lp = response_logprobs(model, hidden, targets, chunk_tokens=3) if chunked else \
            token_logprobs(output_logits(model, hidden), targets)
        grads = torch.autograd.grad(lp.sum(), [hidden, model.output_layer.weight])
        results.append((lp, *grads))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_token_logprobs_leaves_the_logits_alone(single_process, dtype):
    """Megatron's cross entropy works in place; the caller's logits (in fp32 often a custom
    Function's view, which autograd refuses to see modified) must stay as they were."""
    from megatron_longstraw.longstraw.model_steps import token_logprobs

    logits = torch.randn(5, 2, 17, generator=torch.Generator().manual_seed(0)).to(dtype)
    targets = torch.randint(0, 17, (5, 2), generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    logprobs = token_logprobs(logits, targets)
    assert torch.equal(logits, before)
    assert logprobs.dtype == torch.promote_types(dtype, torch.float32)  # fp32, fp64 for fp64 logits
    expected = torch.log_softmax(before.double(), -1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(logprobs.double(), expected, atol=1e-6), (logprobs - expected).abs().max()


def test_token_entropy_and_its_gradient_match_the_softmax_formula(single_process):
    from megatron_longstraw.longstraw.model_steps import token_entropy

    logits = torch.randn(4, 3, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    logits.requires_grad_()
    entropy = token_entropy(logits)
    logp = torch.log_softmax(logits.double(), -1)
    expected = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(entropy.double(), expected, atol=1e-6)
    weights = torch.randn(4, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad((entropy.double() * weights).sum(), logits)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    assert torch.allclose(grad, expected_grad, atol=1e-5)


def test_entropy_loss_replay_equals_full_graph(single_process):
    """A loss that asks for entropies gets the same ones (and gradients) in both modes."""
    hf, model = _model("qwen3.5-debug", torch.float64)
    prompt = _tokens(hf, PROMPT, 5)
    responses = [_tokens(hf, n, 30 + n)[0] for n in (6, 9)]

    def loss_fn(logprobs_RB, mask_RB, indices, entropy_RB=None):
        return -((logprobs_RB + 0.3 * entropy_RB) * mask_RB).sum() / 15

    loss_fn.needs_entropy = True
    full_graph_responses(model, prompt, responses, loss_fn)
    reference = _grads(model)
    with torch.no_grad():
        state = capture_prompt(model, prompt, 16)
    replay_responses(model, state, responses, loss_fn, micro_batch_size=2)
    for name, grad in _grads(model).items():
        rel = max_rel_error(grad, reference[name])
        assert rel <= 1e-5, f"{name}: {rel}"
