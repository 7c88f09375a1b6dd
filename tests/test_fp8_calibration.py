"""FP8 delayed scaling's first backward (``models/fp8.py``): when a model's gradient scales are
still uncalibrated, the replay and the full-graph baseline run their first micro-batch once more
beforehand and drop its gradients, so what accumulates equals a replay without calibration.
Transformer Engine is not on the CPU: the FP8 condition itself is checked on a stand-in config."""

from types import SimpleNamespace

import pytest
import torch

from megatron_longstraw.longstraw import full_graph, replay
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.models import fp8
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.hf_reference import build_hf_model
from megatron_longstraw.testing.parity import megatron_from_hf


def _linear(fp8_format, recipe):
    layer = torch.nn.Linear(4, 3)
    layer.config = SimpleNamespace(fp8=fp8_format, fp8_recipe=recipe)
    return layer


def test_only_delayed_scaling_needs_calibration_and_only_once():
    assert not fp8.gradient_scales_uncalibrated(_linear(None, "delayed"))
    assert not fp8.gradient_scales_uncalibrated(_linear("hybrid", "tensorwise"))
    assert not fp8.gradient_scales_uncalibrated(torch.nn.Linear(4, 3))  # no config at all
    layer = _linear("hybrid", "delayed")
    assert fp8.gradient_scales_uncalibrated(layer)
    layer.weight.main_grad = torch.zeros_like(layer.weight)

    def backward_once():
        layer(torch.ones(2, 4)).sum().backward()
        layer.weight.main_grad += 1.0
    fp8.calibrate_gradient_scales(layer, backward_once)
    assert layer.weight.grad is None and layer.bias.grad is None and not layer.weight.main_grad.any()
    assert not fp8.gradient_scales_uncalibrated(layer)


def test_calibration_refuses_to_drop_accumulated_gradients():
    layer = _linear("hybrid", "delayed")
    layer(torch.ones(2, 4)).sum().backward()
    with pytest.raises(AssertionError, match="before gradients accumulate"):
        fp8.calibrate_gradient_scales(layer, lambda: None)


@pytest.mark.parametrize("path", ["replay", "full_graph"])
def test_calibrating_replay_accumulates_what_a_plain_replay_does(single_process, monkeypatch, path):
    hf = resolve_hf_config("qwen3.5-debug")
    weights = build_hf_model(hf, seed=0).double()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, 40), generator=gen)
    responses = [torch.randint(0, hf["vocab_size"], (n,), generator=gen) for n in (9, 6, 11)]
    calls = []

    def loss_fn(logprobs_RB, mask_RB, indices):
        calls.append(indices)
        return -(logprobs_RB * mask_RB).sum() / 26

    def run(calibrate: bool):
        model = megatron_from_hf(hf, weights, ModelOptions(params_dtype=torch.float64))
        # stands in for "FP8 with delayed scaling" (TE is not on the CPU), the flag as in fp8.py
        monkeypatch.setattr(replay if path == "replay" else full_graph, "gradient_scales_uncalibrated",
                            lambda m: calibrate and not getattr(m, fp8._CALIBRATED, False))
        calls.clear()
        if path == "replay":
            with torch.no_grad():
                state = capture_prompt(model, prompt, 16)
            losses = replay.replay_responses(model, state, responses, loss_fn, micro_batch_size=2)
        else:
            losses = full_graph.full_graph_responses(model, prompt, responses, loss_fn, micro_batch_size=2)
        return losses, list(calls), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_losses, plain_calls, plain = run(False)
    losses, calibrated_calls, grads = run(True)
    assert calibrated_calls == [[0, 1]] + plain_calls  # the first micro-batch once more, first
    assert losses == plain_losses
    assert set(grads) == set(plain)
    for name, want in plain.items():
        assert torch.equal(grads[name], want), name
