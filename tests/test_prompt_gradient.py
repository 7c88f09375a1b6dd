"""``--prompt-gradient exact``: replay with state gradients, then the reverse sweep over the prompt,
against ordinary full backprop through prompt + response with nothing detached (fp64)."""

import pytest
import torch

from megatron_longstraw.core.binding import StatefulModule
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.full_graph import full_graph_responses
from megatron_longstraw.longstraw.prompt_backward import check_prompt_gradient_support
from megatron_longstraw.longstraw.replay import replay_responses
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.hf_reference import build_hf_model
from megatron_longstraw.testing.parity import exact_gradients, max_rel_error, megatron_from_hf, weighted_response_loss

PROMPT = 30


def _model(preset, seed=0, **options):
    hf = resolve_hf_config(preset)
    return hf, megatron_from_hf(hf, build_hf_model(hf, seed=seed).to(torch.float64),
                                ModelOptions(params_dtype=torch.float64, **options))


def _tokens(hf, n, seed):
    return torch.randint(0, hf["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _exact_grads(model, prompt, responses, loss_fn, chunk, micro_batch):
    exact_gradients(model, prompt, responses, loss_fn, chunk, micro_batch)
    return _grads(model)


@pytest.mark.parametrize("preset, chunk, lengths, micro_batch", [
    ("qwen3.5-debug", 10, (13, 1, 7), 1),  # a chunk size that divides the prompt; G = 3, a 1-token response
    ("qwen3.5-debug", 7, (13, 1, 7), 3),   # one that does not; the group in one micro-batch
    ("qwen3.5-debug", 30, (1,), 1),        # one chunk, G = 1 with a 1-token response
    ("qwen3.5-debug", 1, (5,), 3),         # 1-token chunks, G = 1
    # MLA + DSA + MoE; the prompt is longer than the debug index_topk, so selections are sparse
    ("glm-5-debug", 10, (13, 1, 7), 1),
    ("glm-5-debug", 7, (13, 1, 7), 3),
    ("glm-5-debug", 30, (1,), 1),
])
def test_exact_gradients_equal_full_backprop(single_process, preset, chunk, lengths, micro_batch):
    """Every parameter's exact-mode gradient equals full backprop through prompt + responses with
    nothing detached, summed over the responses, to 1e-9 relative (fp64)."""
    hf, model = _model(preset)
    prompt = _tokens(hf, PROMPT, 3)
    responses = [_tokens(hf, n, 10 + n)[0] for n in lengths]
    loss_fn = weighted_response_loss(sum(lengths))
    full_graph_responses(model, prompt, responses, loss_fn, micro_batch_size=1, exact=True)
    reference = _grads(model)
    exact = _exact_grads(model, prompt, responses, loss_fn, chunk, micro_batch)
    assert set(exact) == set(reference)
    for name, ref in reference.items():
        if "local_experts" in name and ref.abs().max() == 0:  # a routed expert none of whose
            # tokens reaches the loss (none selected it, or only prompt rows of the last layer)
            assert exact[name].abs().max() == 0, f"{name}: routed in exact mode only"
            continue
        assert ref.abs().max() > 0, f"{name}: zero reference gradient"
        rel = max_rel_error(exact[name], ref)
        assert rel <= 1e-9, f"{name}: relative gradient error {rel}"


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
def test_exact_gradients_with_activation_recompute(single_process, preset):
    """With Megatron's full activation recomputation (training mode, where it applies) the exact
    mode still equals full backprop: replay's checkpointed layers read the state with gradients
    when they recompute, and the sweep runs its chunk without checkpointing."""
    hf, model = _model(preset, recompute_granularity="full")
    model.train()
    prompt = _tokens(hf, PROMPT, 3)
    responses = [_tokens(hf, n, 10 + n)[0] for n in (13, 1)]
    loss_fn = weighted_response_loss(14)
    full_graph_responses(model, prompt, responses, loss_fn, micro_batch_size=1, exact=True)
    reference = _grads(model)
    exact = _exact_grads(model, prompt, responses, loss_fn, 7, 1)
    assert set(exact) == set(reference)
    assert model.config.recompute_granularity == "full"  # the sweep restores it
    for name, ref in reference.items():
        if ref.abs().max() == 0:  # a routed expert none of whose tokens reaches the loss
            assert exact[name].abs().max() == 0, f"{name}: routed in exact mode only"
            continue
        rel = max_rel_error(exact[name], ref)
        assert rel <= 1e-9, f"{name}: relative gradient error {rel}"


def test_exact_differs_from_detached(single_process):
    """The check above can tell the modes apart: the detached replay's gradients differ from full
    backprop's beyond the bound (parameters below the last layer get a share through the prompt)."""
    hf, model = _model("qwen3.5-debug")
    prompt = _tokens(hf, PROMPT, 3)
    responses = [_tokens(hf, n, 10 + n)[0] for n in (13, 7)]
    loss_fn = weighted_response_loss(20)
    full_graph_responses(model, prompt, responses, loss_fn, micro_batch_size=1, exact=True)
    reference = _grads(model)
    with torch.no_grad():
        state = capture_prompt(model, prompt, 10)
    replay_responses(model, state, responses, loss_fn, 1)
    detached = _grads(model)
    worst = max(max_rel_error(detached[name], ref) for name, ref in reference.items() if name in detached)
    assert worst > 1e-3


class _UnservedLayer(torch.nn.Module, StatefulModule):
    """A stateful layer kind without ``supports_prompt_gradient`` (no reverse sweep)."""


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
def test_exact_refuses_what_it_cannot_serve(single_process, preset):
    """Both served families pass the check; a stateful layer kind without a reverse sweep gets one
    error naming the flag and the layer."""
    _, model = _model(preset)
    check_prompt_gradient_support(model)
    model.decoder.layers[0].add_module("unserved", _UnservedLayer())
    with pytest.raises(ValueError, match=r"^--prompt-gradient exact: layer kind _UnservedLayer "
                                         r"\(decoder\.layers\.0\.unserved\)"):
        check_prompt_gradient_support(model)

