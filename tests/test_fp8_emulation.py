"""The FP8 emulation (``testing/fp8_emulation.py``) that tells FP8's own effect on a model from
Transformer Engine's: casts land on the FP8 grid within FP8's rounding, a switched linear layer
computes forward and backward from the cast operands, delayed scaling casts with the previous
call's amax, and leaving the block restores the model bit for bit."""

import pytest
import torch

from megatron_longstraw.testing.fp8_emulation import (E4M3, E5M2, emulated_fp8_linears, emulated_fp8_matmul,
                                                      quantize_dequantize)
from megatron_longstraw.testing.multiprocess import run_script


@pytest.mark.parametrize("dtype, mantissa_bits", [(E4M3, 3), (E5M2, 2)])
def test_cast_lands_on_the_fp8_grid_within_its_rounding(dtype, mantissa_bits):
    t = torch.randn(4096) * 3.0
    q = quantize_dequantize(t, dtype)
    scale = torch.finfo(dtype).max / t.abs().max().float()
    on_grid = (q * scale).float()  # representable, up to the division by the scale and back
    torch.testing.assert_close(on_grid.to(dtype).float(), on_grid, rtol=1e-6, atol=0)
    normal = (t * scale).abs() >= torch.finfo(dtype).smallest_normal
    relative = ((q - t).abs() / t.abs())[normal]
    assert relative.max() <= 2.0 ** -(mantissa_bits + 1) * (1 + 1e-6) and relative.max() > 0
    torch.testing.assert_close(q.abs().max(), t.abs().max(), rtol=1e-6, atol=0)  # the amax: exact


def test_cast_with_a_smaller_amax_saturates():
    t = torch.linspace(-2.0, 2.0, 101)
    q = quantize_dequantize(t, E4M3, amax=torch.tensor(1.0))
    saturated = q[t.abs() >= 1.0]
    assert q.max() == 1.0 and q.min() == -1.0 and torch.equal(saturated.abs(), torch.ones_like(saturated))


def _tiny_model():
    from megatron_longstraw.models.builder import build_model
    from megatron_longstraw.models.presets import resolve_hf_config

    torch.manual_seed(0)
    return build_model(resolve_hf_config("qwen3.5-debug"))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_switched_linear_computes_forward_and_backward_from_cast_operands(single_process, recipe):
    """Two calls of one MLP input projection: the second call's input is 3x the first's, so
    under delayed scaling it casts with the first call's amax and saturates."""
    fc1 = _tiny_model().decoder.layers[0].mlp.linear_fc1
    w = fc1.weight
    x1 = torch.randn(5, 2, w.shape[1])
    x2 = (3 * x1).requires_grad_()
    grad_y = torch.randn(5, 2, w.shape[0]) * 1e-3
    with emulated_fp8_linears(fc1, recipe):
        fc1(x1)
        y2, _ = fc1(x2)
        y2.backward(grad_y)
    amax_x = x1.abs().max() if recipe == "delayed" else x2.abs().max()
    x8, w8 = quantize_dequantize(x2.detach(), E4M3, amax_x), quantize_dequantize(w.detach(), E4M3)
    g8 = quantize_dequantize(grad_y, E5M2)  # the first backward: its own amax in both recipes
    torch.testing.assert_close(y2, x8 @ w8.t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x2.grad, g8 @ w8, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, g8.reshape(10, -1).t() @ x8.reshape(10, -1), rtol=1e-6, atol=1e-6)
    assert bool(torch.isclose(x8.abs().max(), x1.abs().max())) == (recipe == "delayed")  # delayed: saturated


def test_one_matmul_computes_from_cast_operands():
    """``emulated_fp8_matmul`` alone (a single layer's reference): the product of the E4M3 casts,
    and the gradients from the E5M2 output gradient and the same E4M3 operands."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(64, 16, generator=gen, dtype=torch.float64) * 1e-4
    y = emulated_fp8_matmul(x, w)
    y.backward(dy)
    x8, w8, g8 = quantize_dequantize(x.detach(), E4M3), quantize_dequantize(w.detach(), E4M3), quantize_dequantize(dy, E5M2)
    assert torch.equal(y.detach(), x8 @ w8.t())
    assert torch.equal(x.grad, g8 @ w8) and torch.equal(w.grad, g8.t() @ x8)
    assert not torch.equal(y.detach(), x.detach() @ w.detach().t())  # the casts did round


def test_model_switch_covers_the_te_fp8_gemms_and_restores(single_process):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    model = _tiny_model()
    tokens = torch.randint(0, 256, (1, 64))
    linears = [n for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    with torch.no_grad():
        before = model(tokens, None, None)
        with emulated_fp8_linears(model) as switched:
            fp8 = model(tokens, None, None)
        after = model(tokens, None, None)
    assert switched == len(linears) - 1 and "output_layer" in linears  # all but the output layer
    assert torch.equal(before, after)
    rel = ((fp8 - before).norm() / before.norm()).item()
    assert 1e-4 < rel < 0.1, rel  # FP8 rounding took effect, and only rounding


def test_unknown_recipe_is_refused(single_process):
    with pytest.raises(ValueError, match="emulated FP8 recipe"):
        with emulated_fp8_linears(torch.nn.Linear(2, 2), "mxfp8"):
            pass


@pytest.mark.parametrize("passes", ["forward", "backward"])
def test_one_pass_casts_only_in_that_pass(single_process, passes):
    fc1 = _tiny_model().decoder.layers[0].mlp.linear_fc1
    w = fc1.weight
    x = torch.randn(5, 2, w.shape[1], requires_grad=True)
    grad_y = torch.randn(5, 2, w.shape[0]) * 1e-3
    with emulated_fp8_linears(fc1, passes=passes):
        y, _ = fc1(x)
        y.backward(grad_y)
    forward = passes == "forward"
    x8 = quantize_dequantize(x.detach(), E4M3) if forward else x.detach()
    w8 = quantize_dequantize(w.detach(), E4M3) if forward else w.detach()
    g8 = grad_y if forward else quantize_dequantize(grad_y, E5M2)
    torch.testing.assert_close(y, x8 @ w8.t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, g8 @ w8, rtol=1e-6, atol=1e-6)


def test_sensitivity_tool_end_to_end(tmp_path):
    """``tools/fp8_sensitivity.py`` on the tiny model: every variant reported, FP8 moves the
    gradients further than bf16 rounding does, and a bad flag exits with one line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools/fp8_sensitivity.py"
    run = run_script(tool, ["--model", "qwen3.5-debug", "--prompt-length", "96", "--response-length", "24",
                            "--num-generations", "2", "--prompt-chunk-size", "32", "--output-dir", str(tmp_path)])
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "fp8_sensitivity_qwen3.5-debug.json").read_text())
    variants = report["variants"]
    from megatron_longstraw.models.presets import resolve_hf_config

    layers = resolve_hf_config("qwen3.5-debug")["num_hidden_layers"]
    assert len(variants) == 6 and len(report["layer_rel_err"]) == layers + 1  # and the final norm
    assert 0 < variants["fp8 tensorwise"]["cosine"] < variants["bf16 GEMM operands"]["cosine"] < 1
    # FP8 attention in capture moves the log-probs after the prompt, and the gradients less than
    # FP8 GEMMs everywhere do (only the prompt's attention rounds)
    attention = variants["fp8 attention in capture"]
    assert attention["logprob_abs_diff"] > 0 and variants["bf16 GEMM operands"]["logprob_abs_diff"] > 0
    assert variants["fp8 tensorwise"]["cosine"] < attention["cosine"] < 1
    assert (tmp_path / "fp8_sensitivity_qwen3.5-debug.md").read_text().startswith("# FP8 sensitivity")
    bad = run_script(tool, ["--prompt-length", "0"])
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1] == "error: --prompt-length must be >= 1, got 0"


def test_delayed_scales_move_only_with_gradients_enabled(single_process):
    """Like TE: a no-grad call (a capture chunk) casts with the last scale but does not move it;
    its amax still counts in the running maximum the next call with gradients moves the scale to."""
    fc1 = _tiny_model().decoder.layers[0].mlp.linear_fc1
    w = fc1.weight.detach()
    x = torch.randn(5, 2, w.shape[1])
    w8 = quantize_dequantize(w, E4M3)
    with emulated_fp8_linears(fc1, "delayed"):
        fc1(x)  # with gradients: the input scale now comes from x
        with torch.no_grad():
            y_big, _ = fc1(6 * x)  # cast with x's amax (saturates) and leaves it
            y_again, _ = fc1(4 * x)
        y_last, _ = fc1(4 * x)  # still x's amax: the no-grad calls did not move it; this call does
        y_moved, _ = fc1(4 * x)  # the largest amax since x: 6x's, from a no-grad call
        y_fresh, _ = fc1(4 * x)  # the maximum started afresh after the move: 4x's own amax
    cast = lambda t, amax: quantize_dequantize(t, E4M3, amax) @ w8.t()  # noqa: E731
    torch.testing.assert_close(y_big, cast(6 * x, x.abs().max()), rtol=1e-6, atol=1e-6)
    for y in (y_again, y_last):
        torch.testing.assert_close(y, cast(4 * x, x.abs().max()), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y_moved, cast(4 * x, 6 * x.abs().max()), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y_fresh, cast(4 * x, None), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- FP8 attention


def _attention_inputs(dtype=torch.float64, seed=0, prefix=19, seq=7, batch=3, heads=4, groups=2, dim=16):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)  # noqa: E731
    return (rand(seq, batch, heads, dim), rand(seq, batch, groups, dim), rand(seq, batch, groups, dim),
            rand(prefix, 1, groups, dim), rand(prefix, 1, groups, dim))


def test_fp8_attention_without_its_casts_is_exact_attention(monkeypatch):
    """The emulation's structure (pages shared over the samples, causal chunk, grouped heads,
    normalization by the uncast row sums) with every cast made exact equals the fp64 reference."""
    from megatron_longstraw.attention.prefix_attention import prefix_causal_attention_math
    from megatron_longstraw.testing import fp8_attention_emulation

    inputs = _attention_inputs()
    monkeypatch.setattr(fp8_attention_emulation, "quantize_dequantize", lambda t, dtype, amax=None: t)
    got = fp8_attention_emulation.fp8_prefix_attention(*inputs, scale=0.3)
    want = prefix_causal_attention_math(*inputs, scale=0.3)
    assert (got - want).abs().max().item() < 1e-12
    no_prefix = fp8_attention_emulation.fp8_prefix_attention(*inputs[:3], None, None)
    assert (no_prefix - prefix_causal_attention_math(*inputs[:3])).abs().max().item() < 1e-12


def test_fp8_attention_error_is_of_e4m3_size():
    """With its casts, the output moves by E4M3's rounding (3 mantissa bits: a relative step of
    1/8 at most), far more than bf16 rounding of the same operands and far less than the output."""
    from megatron_longstraw.attention.prefix_attention import prefix_causal_attention_math
    from megatron_longstraw.testing.fp8_attention_emulation import fp8_prefix_attention

    inputs = _attention_inputs(prefix=200, seq=32, dim=64)
    want = prefix_causal_attention_math(*inputs)
    fp8 = (fp8_prefix_attention(*inputs) - want).norm() / want.norm()
    bf16 = (prefix_causal_attention_math(*(t.to(torch.bfloat16).double() for t in inputs)) - want).norm() / want.norm()
    assert 4 * bf16 < fp8 < 0.1, (fp8.item(), bf16.item())


def test_capture_hook_changes_the_capture_only(single_process):
    """Inside ``emulated_fp8_capture_attention`` the capture's full-attention layers call the
    emulation once per chunk and layer, replay calls it never, the state's last logits move, and
    leaving restores the hooks."""
    from megatron_longstraw.attention.sdpa_core import SDPACoreAttention
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.replay import replay_responses
    from megatron_longstraw.testing import fp8_attention_emulation

    model = _tiny_model()
    cores = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
    calls = []
    real = fp8_attention_emulation.fp8_prefix_attention
    prompt = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    response = torch.randint(0, 200, (6,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = capture_prompt(model, prompt, 16)
    with fp8_attention_emulation.emulated_fp8_capture_attention(model):
        assert all(core.capture_attention is real for core in cores)  # installed on every core
        for core in cores:
            core.capture_attention = lambda *a, **k: calls.append(1) or real(*a, **k)
        with torch.no_grad():
            fp8 = capture_prompt(model, prompt, 16)
        assert len(calls) == 3 * len(cores)  # chunks of 16, 16 and 8
        replay_responses(model, fp8, [response], lambda lp, mask, idx: -(lp * mask).sum(), 1)
        assert len(calls) == 3 * len(cores)
    assert all(core.capture_attention is None for core in cores)
    moved = (fp8.last_logits_BV - plain.last_logits_BV).abs().max().item()
    assert 0 < moved < 0.1 * plain.last_logits_BV.abs().max().item()
