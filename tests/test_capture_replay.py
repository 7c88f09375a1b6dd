"""Capture + replay against the full graph (fp32 logits; fp64 gradients), the state's contents."""

import pytest
import torch

from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.full_graph import full_graph_responses
from megatron_longstraw.longstraw.replay import replay_logits, replay_responses
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.hf_reference import build_hf_model
from megatron_longstraw.testing.parity import forward_logits, megatron_from_hf

PROMPT, RESPONSE = 45, 13


def _model(preset, dtype=torch.float32, seed=0):
    hf = resolve_hf_config(preset)
    return hf, megatron_from_hf(hf, build_hf_model(hf, seed=seed).to(dtype), ModelOptions(params_dtype=dtype))


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


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
def test_replay_gradients_equal_stop_gradient_full_graph(single_process, preset):
    """fp64: some random-model gradients are too small for fp32 to resolve 1e-5 (see parity.py)."""
    hf, model = _model(preset, torch.float64)
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
        rel = ((replayed[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        assert rel <= 1e-5, f"{name}: relative gradient error {rel}"
        assert ref.abs().max() > 0, f"{name}: zero reference gradient"


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
def test_one_by_one_equals_one_micro_batch(single_process, preset):
    hf, model = _model(preset, torch.float64)
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
