"""GPU tier, Transformer Engine (installed on the host with ``scripts/gpu_host.sh te-piece`` and
``te-build``): the TE spec of both families against the local spec on the same weights, FP8
replay against bf16 on ``qwen3.5-0.8b`` at a 32K prompt, FP8 stability over 20 replays, and an
FP8 recipe this GPU cannot run.
Capture/replay parity with the TE spec runs in ``test_longstraw_gpu.py`` and ``test_dsa_gpu.py``
(their ``transformer_engine`` cases)."""

import pytest
import torch

from megatron_longstraw.models.options import ModelOptions, have_transformer_engine
from megatron_longstraw.patches import cpu_gated_delta_kernels as torch_gdn_kernels
from megatron_longstraw.testing.parity import bf16_and_fp32_models, forward_logits, megatron_from_hf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not have_transformer_engine(),
                                 reason="needs Transformer Engine (scripts/gpu_host.sh te-piece, te-build)")]

BF16 = torch.bfloat16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
def test_te_spec_logits_match_local_spec_bf16(single_process, preset, record_property):
    """Same (bf16-rounded) weights in the local and the TE spec: both against the fp32 local
    forward; TE may be at most twice as far (or 2e-2: bf16 GEMMs in another order)."""
    from megatron_longstraw.testing.hf_reference import build_hf_model

    # GLM: a top-k over every token, or bf16 flips DSA selections (see test_dsa_gpu.DENSE_TOPK)
    hf, local, truth_model = bf16_and_fp32_models(preset, **({"index_topk": 1024} if preset.startswith("glm") else {}))
    te_model = megatron_from_hf(hf, build_hf_model(hf, seed=0).to("cuda", BF16),
                                ModelOptions(params_dtype=BF16, transformer_impl="transformer_engine"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, hf["vocab_size"], (2, 300), device="cuda", generator=gen)
    switch = not torch_gdn_kernels.needed()  # the fp32 truth on the torch Gated DeltaNet kernels
    with torch.no_grad():
        if switch:
            torch_gdn_kernels.apply()
        try:
            truth = forward_logits(truth_model, tokens)
        finally:
            if switch:
                torch_gdn_kernels.revert()
        local_err, te_err = _rel(forward_logits(local, tokens), truth), _rel(forward_logits(te_model, tokens), truth)
    record_property("rel_err_local_te", f"{local_err:.1e},{te_err:.1e}")
    assert te_err <= max(2 * local_err, 2e-2), (local_err, te_err)


def _qwen_08b_pair(recipe: str):
    """``qwen3.5-0.8b`` with the TE spec in bf16 and in FP8 (hybrid, ``recipe``), same weights."""
    from megatron_longstraw.models.builder import build_model
    from megatron_longstraw.models.presets import resolve_hf_config

    hf = resolve_hf_config("qwen3.5-0.8b")
    bf16 = build_model(hf, ModelOptions(params_dtype=BF16, transformer_impl="transformer_engine"))
    fp8 = build_model(hf, ModelOptions(params_dtype=BF16, transformer_impl="transformer_engine",
                                       fp8_format="hybrid", fp8_recipe=recipe))
    with torch.no_grad():
        for a, b in zip(fp8.parameters(), bf16.parameters(), strict=True):
            a.copy_(b)
    return hf, bf16, fp8


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_replay_tracks_bf16_on_qwen_0_8b_at_32k(single_process, record_property, recipe):
    """32K-token prompt, two 1,024-token responses: FP8 capture + replay against bf16 capture +
    replay of the same weights, from the model's very first replay (delayed scaling calibrates
    its gradient scales there, ``models/fp8.py``): loss within 1%; then 20 more FP8 captures and
    replays (delayed-scaling histories advancing) stay finite in loss and gradients. The gradient
    cosine and the parameters that pull it down are recorded; it is judged against the emulated
    FP8's (``test_te_fp8_moves_gradients_no_further_than_emulated_fp8``), since on random
    weights FP8 numerics alone take it to about 0.42 (``tools/fp8_sensitivity.py``)."""
    from megatron_longstraw.testing.parity import replay_gradients

    hf, bf16, fp8 = _qwen_08b_pair(recipe)
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, 32768), device="cuda", generator=gen)
    responses = [torch.randint(0, hf["vocab_size"], (1024,), device="cuda", generator=gen) for _ in range(2)]
    loss16, grads16 = replay_gradients(bf16, prompt, responses, 8192)
    loss8, grads8 = replay_gradients(fp8, prompt, responses, 8192)
    grads16, grads8 = ({n: g.float() for n, g in grads.items()} for grads in (grads16, grads8))
    assert grads8.keys() == grads16.keys(), sorted(grads8.keys() ^ grads16.keys())  # aligned by name
    names = sorted(grads16)
    loss_error = abs(loss8 - loss16) / abs(loss16)
    cosine = torch.nn.functional.cosine_similarity(torch.cat([grads8[n] for n in names]),
                                                   torch.cat([grads16[n] for n in names]), dim=0).item()
    # per parameter: its cosine and its share of the bf16 gradient's squared norm (which ones
    # pull the whole-model cosine down)
    total = sum(grads16[n].square().sum() for n in names)
    per_param = sorted((torch.nn.functional.cosine_similarity(grads8[n], grads16[n], dim=0).item(),
                        (grads16[n].square().sum() / total).item(), n) for n in names)
    record_property("worst_params_cosine_share", "; ".join(f"{n} {c:.3f} {w:.1%}" for c, w, n in per_param[:4]))
    finite = []
    for _ in range(20):
        loss, grads = replay_gradients(fp8, prompt, responses, 8192)
        finite.append(bool(torch.isfinite(torch.tensor(loss))) and all(bool(g.isfinite().all()) for g in grads.values()))
    record_property("loss_rel_err_grad_cosine", f"{loss_error:.2e},{cosine:.4f}")
    record_property("finite_replays", f"{sum(finite)}/{len(finite)}")
    assert all(finite), finite
    assert loss_error <= 0.01, loss_error



@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_capture_sees_weights_changed_since_the_last_capture(single_process, record_property, recipe):
    """TE keeps each weight's FP8 copy from a layer's first call on (Megatron passes
    ``is_first_microbatch=False`` after it), so each capture makes the layers cast again
    (``models/fp8.py``). Between two captures of one FP8 model (4 layers of ``qwen3.5-0.8b``:
    the debug sizes are not FP8's multiples of 16) the elements of every parameter are shuffled
    in place (new weights of the same amax and spread, so delayed scaling's scales still fit).
    Judged against the bf16 model of the shuffled weights: the second capture's logits no
    further from them than a fresh FP8 model's (1.5x: under delayed scaling the two cast with
    scales from different amaxes), and the first capture's (what stale FP8 weights give) far off."""
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.models.builder import build_model
    from megatron_longstraw.models.presets import resolve_hf_config, with_num_layers

    hf = with_num_layers(resolve_hf_config("qwen3.5-0.8b"), 4)
    options = ModelOptions(params_dtype=BF16, transformer_impl="transformer_engine", fp8_format="hybrid",
                           fp8_recipe=recipe)
    model, fresh = build_model(hf, options), build_model(hf, options)
    plain = build_model(hf, ModelOptions(params_dtype=BF16, transformer_impl="transformer_engine"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, 512), device="cuda", generator=gen)
    with torch.no_grad():
        before = capture_prompt(model, prompt, 128).last_logits_BV
        for p in model.parameters():  # what an optimizer step does, writ large
            p.copy_(p.flatten()[torch.randperm(p.numel(), device=p.device, generator=gen)].view_as(p))
        for other in (fresh, plain):
            for a, b in zip(other.parameters(), model.parameters(), strict=True):
                a.copy_(b)
        after = capture_prompt(model, prompt, 128).last_logits_BV
        reference = capture_prompt(fresh, prompt, 128).last_logits_BV
        truth = capture_prompt(plain, prompt, 128).last_logits_BV
    error, fresh_error, stale = _rel(after, truth), _rel(reference, truth), _rel(before, truth)
    record_property("rel_err_after_fresh_stale", f"{error:.2e},{fresh_error:.2e},{stale:.2e}")
    assert error <= 1.5 * fresh_error and stale >= 3 * fresh_error, (error, fresh_error, stale)


def test_delayed_scaling_first_capture_sets_forward_scales(single_process):
    """A fresh delayed-scaling model's first capture leaves every TE layer's forward scales set
    from real amaxes, not TE's initial 1.0: TE moves them only when an autocast exits with
    gradients enabled, which the no-grad capture never does (``fp8.prepare_forward``)."""
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.models.builder import build_model
    from megatron_longstraw.models.presets import resolve_hf_config

    hf = resolve_hf_config("qwen3.5-0.8b")
    model = build_model(hf, ModelOptions(params_dtype=BF16, transformer_impl="transformer_engine",
                                         fp8_format="hybrid", fp8_recipe="delayed"))
    prompt = torch.randint(0, hf["vocab_size"], (1, 512), device="cuda")
    with torch.no_grad():
        capture_prompt(model, prompt, 128)
    scales = {n: m.fp8_meta["scaling_fwd"].scale for n, m in model.named_modules()
              if "scaling_fwd" in getattr(m, "fp8_meta", {})}
    # per GEMM TE keeps [input, weight, output] scales; the output one has no amax and stays 1.0
    assert scales and all(bool((s.view(-1, 3)[:, :2] != 1.0).all()) for s in scales.values()), \
        {n: s.tolist() for n, s in scales.items()}


def _replay_gradients(model, prompt, responses):
    """``parity.replay_gradients`` in 8K chunks, its gradients as one vector in name order."""
    from megatron_longstraw.testing.parity import replay_gradients

    loss, grads = replay_gradients(model, prompt, responses, 8192)
    return loss, torch.cat([grads[n].float() for n in sorted(grads)])


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_te_fp8_moves_gradients_no_further_than_emulated_fp8(single_process, record_property, recipe):
    """On random weights FP8 rounding alone moves qwen3.5-0.8b's replay gradients far from bf16's
    (emulated on CPU: cosine 0.42, ``docs/transformer_engine.md``). So TE's FP8 is judged against
    the same FP8 numerics emulated in torch on the local spec (``testing/fp8_emulation.py``), same
    weights, 32K prompt and responses: TE's gradient cosine to its bf16 model may be at most 0.05
    below the emulation's cosine to the local bf16 model (lower means TE adds an error of its
    own), and TE's FP8 loss within 1% of its bf16 loss."""
    from megatron_longstraw.models.builder import build_model, spec_param_name
    from megatron_longstraw.testing.fp8_emulation import emulated_fp8_linears

    hf, bf16, fp8 = _qwen_08b_pair(recipe)
    local = build_model(hf, ModelOptions(params_dtype=BF16))
    te_params = dict(bf16.named_parameters())
    with torch.no_grad():  # the TE spec fuses the norms into the next linear: map the names
        for name, p in local.named_parameters():
            p.copy_(te_params[spec_param_name(name, te_params)])
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, 32768), device="cuda", generator=gen)
    responses = [torch.randint(0, hf["vocab_size"], (1024,), device="cuda", generator=gen) for _ in range(2)]
    cosine = lambda a, b: torch.nn.functional.cosine_similarity(a[1], b[1], dim=0).item()  # noqa: E731
    te_fp8, te_bf16 = _replay_gradients(fp8, prompt, responses), _replay_gradients(bf16, prompt, responses)
    te_cosine, loss_error = cosine(te_fp8, te_bf16), abs(te_fp8[0] - te_bf16[0]) / abs(te_bf16[0])
    del bf16, fp8, te_params, te_fp8, te_bf16
    reference = _replay_gradients(local, prompt, responses)
    with emulated_fp8_linears(local, recipe):
        emulated_cosine = cosine(_replay_gradients(local, prompt, responses), reference)
    record_property("te_vs_emulated_cosine_loss_rel_err", f"{te_cosine:.4f},{emulated_cosine:.4f},{loss_error:.2e}")
    assert te_cosine >= emulated_cosine - 0.05 and loss_error <= 0.01, (te_cosine, emulated_cosine, loss_error)


def _exact_layer(x, weight, gamma, zero_centered_gamma, eps, fp8: bool):
    """What a TE linear (``gamma`` None) or RMSNorm + linear computes, in fp32 from ``x``'s and
    the parameters' values: exactly, or (``fp8``) as the ideal FP8 GEMM of the hybrid format
    (``testing/fp8_emulation``: E4M3 input and weight, E5M2 output gradient, one scale each)."""
    from megatron_longstraw.testing.fp8_emulation import emulated_fp8_matmul

    x = x.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    g = None if gamma is None else gamma.detach().float().requires_grad_()
    h = x if g is None else torch.nn.functional.rms_norm(x, x.shape[-1:], (1 + g) if zero_centered_gamma else g, eps)
    y = emulated_fp8_matmul(h, w) if fp8 else h @ w.t()
    return y, [x, w] + ([] if g is None else [g])


@pytest.mark.parametrize("layer_kind", ["linear", "norm_linear", "norm_linear_zero_centered"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_te_fp8_layer_is_as_accurate_as_its_emulation(recipe, layer_kind, record_property):
    """Each kind of TE layer the TE spec runs in FP8, alone: ``te.Linear`` (the output
    projections) and the fused RMSNorm + linear ``te.LayerNormLinear`` (the input projections;
    Qwen3.5's zero-centered norm weight as one case), FP8 hybrid. Its output, input gradient,
    weight gradient (and norm weight gradient) against the exact fp32 layer on the same values
    must be no further than the ideal FP8 emulation's, within 1.2x (and the bf16 TE layer's
    error, the floor, is printed beside them). A TE defect of its own (a scale left at 1.0,
    a flushed gradient, a stale FP8 weight) lands far above the emulation."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    torch.manual_seed(0)
    eps, zero_centered = 1e-6, layer_kind == "norm_linear_zero_centered"
    if layer_kind == "linear":
        layer = te.Linear(4096, 1024, bias=False, params_dtype=BF16, device="cuda")
        x = torch.randn(8192, 4096, device="cuda", dtype=BF16)
        gamma = None
    else:
        layer = te.LayerNormLinear(1024, 4096, bias=False, normalization="RMSNorm", eps=eps,
                                   zero_centered_gamma=zero_centered, params_dtype=BF16, device="cuda")
        with torch.no_grad():
            layer.layer_norm_weight.normal_(0.0 if zero_centered else 1.0, 0.1)
        gamma = layer.layer_norm_weight
        x = torch.randn(8192, 1024, device="cuda", dtype=BF16)
    x.requires_grad_()
    dy = torch.randn(8192, layer.weight.shape[0], device="cuda", dtype=BF16) * 1e-4  # a loss normalized over many tokens
    fp8_recipe = (te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID) if recipe == "delayed"
                  else te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID))

    def run_te(fp8: bool):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe if fp8 else None):
            y = layer(x)
        y.backward(dy)
        return [t.detach().float() for t in [y, x.grad, layer.weight.grad]
                + ([] if gamma is None else [gamma.grad])]

    def run_exact(fp8: bool):
        y, leaves = _exact_layer(x, layer.weight, gamma, zero_centered, eps, fp8)
        y.backward(dy.float())
        return [y.detach()] + [t.grad for t in leaves]

    truth, emulated = run_exact(False), run_exact(True)
    te_bf16 = run_te(False)
    for _ in range(3):  # delayed scaling: the third pass casts with amaxes of these very tensors
        te_fp8 = run_te(True)
    names = ["y", "dx", "dw", "dgamma"][:len(truth)]
    errors = {name: (_rel(a, t), _rel(b, t), _rel(c, t))
              for name, a, b, c, t in zip(names, te_fp8, emulated, te_bf16, truth)}
    record_property("rel_err_te_fp8_emulated_te_bf16", "; ".join(
        f"{n} {a:.2e},{b:.2e},{c:.2e}" for n, (a, b, c) in errors.items()))
    assert all(a <= 1.2 * b for a, b, _ in errors.values()), errors


def test_unsupported_fp8_recipe_names_the_flags(single_process):
    """MXFP8 needs Blackwell (compute capability 10): on Hopper the model build refuses it with
    one line naming the flags."""
    from megatron_longstraw.models.builder import build_model
    from megatron_longstraw.models.presets import resolve_hf_config

    if torch.cuda.get_device_capability()[0] >= 10:
        pytest.skip("this GPU runs MXFP8")
    options = ModelOptions(params_dtype=BF16, transformer_impl="transformer_engine", fp8_format="e4m3",
                           fp8_recipe="mxfp8")
    with pytest.raises(ValueError, match=r"--fp8-format e4m3 --fp8-recipe mxfp8 is not supported") as err:
        build_model(resolve_hf_config("qwen3.5-debug"), options)
    assert "\n" not in str(err.value)
