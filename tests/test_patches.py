"""The CPU-compat patches: each is what makes the Megatron code path run on a CPU."""

import pytest
import torch

from megatron_longstraw import patches
from megatron_longstraw.ops import gated_delta_torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-compat patches apply without a GPU")


def test_every_patch_module_has_the_interface():
    for name in patches.PATCHES:
        module = patches._module(name)
        assert callable(module.needed) and callable(module.apply) and callable(module.revert)
        assert module.__doc__, name


def test_current_device_patch_is_what_makes_megatron_allocation_work():
    patches.apply_patches()
    patches._module("cpu_current_device").revert()
    try:
        with pytest.raises((RuntimeError, AssertionError)):
            torch.empty(1, device=torch.cuda.current_device())
    finally:
        patches._module("cpu_current_device").apply()
    assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"


def test_rng_tracker_gives_distinct_reproducible_streams_per_tp_rank():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    patches.apply_patches()
    draws = {}
    for tp_rank in (0, 1, 0):
        model_parallel_cuda_manual_seed(7, tp_rank=tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True)
        before = torch.get_rng_state()
        with get_cuda_rng_tracker().fork():
            sample = torch.randn(4)
        assert torch.equal(torch.get_rng_state(), before)  # the caller's stream is untouched
        draws.setdefault(tp_rank, []).append(sample)
    assert torch.equal(draws[0][0], draws[0][1])
    assert not torch.equal(draws[0][0], draws[1][0])


def _naive_gated_delta_rule(q, k, v, g, beta, state=None):
    """Token-by-token recurrence S_t = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T k_t)^T."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    q = gated_delta_torch.l2norm(q.double()) * dk ** -0.5
    k = gated_delta_torch.l2norm(k.double())
    v, g, beta = v.double(), g.double(), beta.double()
    state = torch.zeros(b, h, dk, dv, dtype=torch.float64) if state is None else state.double()
    out = torch.zeros(b, t, h, dv, dtype=torch.float64)
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        kv = torch.einsum("bhk,bhkv->bhv", k[:, i], state)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, i], (v[:, i] - kv) * beta[:, i, :, None])
        out[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i], state)
    return out, state


def test_torch_gated_delta_rule_matches_naive_recurrence_and_chains_state():
    gen = torch.Generator().manual_seed(0)
    b, t, h, dk, dv = 2, 150, 3, 8, 12
    q, k = torch.randn(b, t, h, dk, generator=gen), torch.randn(b, t, h, dk, generator=gen)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen)
    beta = torch.rand(b, t, h, generator=gen)
    expected, expected_state = _naive_gated_delta_rule(q, k, v, g, beta)
    out, state = gated_delta_torch.chunk_gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert (out.double() - expected).abs().max() < 1e-5
    assert (state.double() - expected_state).abs().max() < 1e-5
    # two halves chained through the state equal one pass
    cut = 77
    first, mid = gated_delta_torch.chunk_gated_delta_rule(
        q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    second, _ = gated_delta_torch.chunk_gated_delta_rule(
        q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], initial_state=mid,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert (torch.cat([first, second], 1).double() - expected).abs().max() < 1e-5


def test_torch_causal_conv1d_matches_padded_conv_and_chains_state():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 19, 6, generator=gen)
    weight = torch.randn(6, 4, generator=gen)
    padded = torch.nn.functional.pad(x.transpose(1, 2), (3, 0))
    expected = torch.nn.functional.silu(
        torch.nn.functional.conv1d(padded, weight.unsqueeze(1), groups=6)).transpose(1, 2)
    out, _ = gated_delta_torch.causal_conv1d(x, weight, activation="silu")
    assert torch.allclose(out, expected, atol=1e-6)
    first, state = gated_delta_torch.causal_conv1d(x[:, :5], weight, activation="silu",
                                                   output_final_state=True)
    second, _ = gated_delta_torch.causal_conv1d(x[:, 5:], weight, activation="silu",
                                                initial_state=state)
    assert torch.allclose(torch.cat([first, second], 1), expected, atol=1e-6)


def test_tensor_cuda_patch_keeps_tensors_on_cpu():
    patches.apply_patches()
    patches._module("cpu_tensor_cuda").revert()
    try:
        with pytest.raises((RuntimeError, AssertionError)):
            torch.ones(1).cuda()
    finally:
        patches._module("cpu_tensor_cuda").apply()
    t = torch.ones(1)
    assert t.cuda() is t
