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


@pytest.mark.parametrize("failing", ["forward", "update"])
def test_failed_calibration_leaves_the_model_uncalibrated(monkeypatch, failing):
    layer = _linear("hybrid", "delayed")
    layer.set_is_first_microbatch = lambda: None  # a Megatron module's method

    def fail():
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(fp8, "update_delayed_forward_scales", fail if failing == "update" else lambda: None)
    with pytest.raises(RuntimeError, match="out of memory"):
        fp8.prepare_forward(layer, fail if failing == "forward" else lambda: None)
    assert fp8.forward_scales_uncalibrated(layer)  # the next pass calibrates again


def test_failed_gradient_calibration_leaves_the_model_uncalibrated_and_no_gradients():
    """A calibration backward that fails halfway (out of memory): the next replay calibrates
    again, and what the failed one accumulated is gone."""
    layer = _linear("hybrid", "delayed")
    layer.weight.main_grad = torch.zeros_like(layer.weight)

    def backward_then_fail():
        layer(torch.ones(2, 4)).sum().backward()
        layer.weight.main_grad += 1.0
        raise RuntimeError("CUDA out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        fp8.calibrate_gradient_scales(layer, backward_then_fail)
    assert fp8.gradient_scales_uncalibrated(layer)
    assert layer.weight.grad is None and layer.bias.grad is None and not layer.weight.main_grad.any()


def _record_forwards(model, monkeypatch):
    """Events of ``model``: "cast" when its TE layers are told to cast their weights to FP8 again
    (``set_is_first_microbatch``), "update" when TE is told to set the delayed forward scales from
    the recorded amaxes, "forward" for each decoder pass."""
    events = []
    monkeypatch.setattr(model, "set_is_first_microbatch", lambda: events.append("cast"))
    monkeypatch.setattr(fp8, "update_delayed_forward_scales", lambda: events.append("update"))
    model.decoder.register_forward_pre_hook(lambda module, args: events.append("forward"))
    return events


@pytest.mark.parametrize("path", ["capture", "full_graph"])
@pytest.mark.parametrize("delayed", [False, True])
def test_each_pass_recasts_weights_and_delayed_scaling_calibrates_its_first_forward(single_process, monkeypatch,
                                                                                   path, delayed):
    """Every capture (and full-graph pass) first makes the TE layers cast their weights to FP8
    again (an optimizer step may have changed them). Under delayed scaling a model's first pass
    runs its first chunk beforehand, its result dropped, and has TE update the forward scales
    from it (no-grad passes do not), twice (the second pass on weights cast with real scales),
    so the cast uses calibrated scales; the captured state is what a capture without it gives."""
    hf = resolve_hf_config("qwen3.5-debug")
    weights = build_hf_model(hf, seed=0).double()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, 40), generator=gen)
    responses = [torch.randint(0, hf["vocab_size"], (7,), generator=gen)]

    def run(calibrate: bool):
        model = megatron_from_hf(hf, weights, ModelOptions(params_dtype=torch.float64))
        # stands in for "FP8 with delayed scaling" (TE is not on the CPU), the flag as in fp8.py
        monkeypatch.setattr(fp8, "forward_scales_uncalibrated",
                            lambda m: calibrate and not getattr(m, fp8._FORWARD_CALIBRATED, False))
        events = _record_forwards(model, monkeypatch)
        results = []
        for _ in range(2):  # a second pass calibrates no more
            if path == "capture":
                with torch.no_grad():
                    state = capture_prompt(model, prompt, 16)  # its last logits depend on every chunk
                    results.append(torch.cat([state.last_hidden_1BH.flatten(), state.last_logits_BV.flatten()]))
            else:
                results.append(full_graph.full_graph_responses(model, prompt, responses, lambda lp, m, i: -lp.sum()))
        return results, events

    plain, plain_events = run(False)
    results, events = run(delayed)
    passes = ["forward"] * 3 if path == "capture" else ["forward"]  # 40 tokens in chunks of 16
    # twice: one chunk (a capture of its own, which casts too), or the prompt + one response
    # without gradients, each followed by TE's scale update
    calibration = [] if not delayed else 2 * (["cast", "cast", "forward", "update"] if path == "capture"
                                              else ["cast", "forward", "update"])
    assert plain_events == (["cast"] + passes) * 2
    assert events == calibration + (["cast"] + passes) * 2
    for got, want in zip(results, plain):
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(want))
