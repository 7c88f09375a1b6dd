"""The GPU prefix-attention logic (folding, prefix blocks, LSE merge, merged-LSE backward) on CPU.

``KernelOptions(attention_backend="emulated")`` runs the fused-kernel interface in plain torch, so what
is checked here is the orchestration in ``prefix_attention_cuda``; the kernels themselves are
checked on the GPU host (``tests/gpu/test_longstraw_gpu.py``).
"""

import functools

import pytest
import torch

from megatron_longstraw.attention.prefix_attention import prefix_causal_attention_math
from megatron_longstraw.attention.prefix_attention_cuda import prefix_causal_attention_cuda
from megatron_longstraw.config.kernels import KernelOptions


@pytest.mark.parametrize("block", [1_000_000, 64, 7])
@pytest.mark.parametrize("batch,prefix", [(1, 150), (3, 97), (2, 0)])
def test_orchestration_matches_one_softmax(block, batch, prefix):
    options = KernelOptions(attention_backend="emulated", prefix_block=block)
    gen = torch.Generator().manual_seed(batch * 1000 + prefix)
    seq, heads, groups, dim = 11, 6, 2, 8
    q = torch.randn(seq, batch, heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(seq, batch, groups, dim, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    pk, pv = (torch.randn(prefix, 1, groups, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(seq, batch, heads, dim, generator=gen, dtype=torch.float64)
    results = []
    for fn in (functools.partial(prefix_causal_attention_cuda, options=options), prefix_causal_attention_math):
        out = fn(q, k, v, pk, pv)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for got, want in zip(*results):
        assert (got - want).abs().max().item() < 1e-12


def _attention_inputs(gen, seq, batch, heads, groups, dim, prefix, prefix_grad=(True, True)):
    """fp64 ``q, k, v`` (requiring grad), the batch-1 prefix ``pk, pv`` (requiring grad as
    ``prefix_grad`` says) and an upstream gradient."""
    q = torch.randn(seq, batch, heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(seq, batch, groups, dim, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    pk, pv = (torch.randn(prefix, 1, groups, dim, generator=gen, dtype=torch.float64).requires_grad_(wants)
              for wants in prefix_grad)
    grad = torch.randn(seq, batch, heads, dim, generator=gen, dtype=torch.float64)
    return q, k, v, pk, pv, grad


def _relative(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("block,batch,prefix,heads,groups,seq", [
    (7, 3, 50, 6, 2, 11),          # several blocks, the last one short; GQA; G responses share the prefix
    (1_000_000, 1, 31, 4, 4, 9),   # one block, one query head per group
    (16, 2, 48, 6, 3, 5),          # blocks dividing the prefix
    (1, 2, 9, 4, 2, 6),            # one key per block
    (5, 2, 23, 6, 2, 1),           # a response of one token
])
def test_prefix_gradients_match_one_softmax(block, batch, prefix, heads, groups, seq):
    """A prefix that requires grad: the fused path's gradients of q, k, v and of the batch-1
    prefix keys/values (summed over every sample and query head of a group) equal one softmax's."""
    options = KernelOptions(attention_backend="emulated", prefix_block=block)
    gen = torch.Generator().manual_seed(block + 100 * prefix + 10_000 * seq)
    q, k, v, pk, pv, grad = _attention_inputs(gen, seq, batch, heads, groups, 8, prefix)
    results = []
    for fn in (functools.partial(prefix_causal_attention_cuda, options=options), prefix_causal_attention_math):
        out = fn(q, k, v, pk, pv)
        results.append((out, *torch.autograd.grad(out, (q, k, v, pk, pv), grad)))
    fused, math = results
    assert fused[4].shape == pk.shape and fused[5].shape == pv.shape
    for name, got, want in zip(("out", "dq", "dk", "dv", "dpk", "dpv"), fused, math):
        assert _relative(got, want) < 1e-10, name


@pytest.mark.parametrize("prefix_grad", [(False, False), (True, False), (False, True)])
def test_prefix_gradients_only_where_required(monkeypatch, prefix_grad):
    """A prefix that does not require grad gets none (nothing is allocated for it) and the rest
    is unchanged: output and q, k, v gradients as with a prefix that requires grad, and the math
    path's; a prefix of which only the keys (or values) require grad gets only that gradient."""
    import megatron_longstraw.attention.prefix_attention_cuda as cuda

    options = KernelOptions(attention_backend="emulated", prefix_block=6)
    grads_returned = []
    blocks_grads = cuda.prefix_blocks_grads

    def recording(*args, **kwargs):
        dq, dpk, dpv = blocks_grads(*args, **kwargs)
        grads_returned.append((dpk is not None, dpv is not None))
        return dq, dpk, dpv

    monkeypatch.setattr(cuda, "prefix_blocks_grads", recording)
    results = {}
    for wants in (prefix_grad, (True, True)):
        gen = torch.Generator().manual_seed(3)
        q, k, v, pk, pv, grad = _attention_inputs(gen, 7, 2, 6, 2, 8, 20, wants)
        for name, fn in (("fused", functools.partial(prefix_causal_attention_cuda, options=options)),
                         ("math", prefix_causal_attention_math)):
            out = fn(q, k, v, pk, pv)
            out.backward(grad)
            results[wants, name] = (out.detach(), q.grad, k.grad, v.grad, pk.grad, pv.grad)
            q.grad = k.grad = v.grad = pk.grad = pv.grad = None
    assert grads_returned == [prefix_grad, (True, True)]
    got, reference, math = results[prefix_grad, "fused"], results[(True, True), "fused"], results[prefix_grad, "math"]
    for wants, dp in zip(prefix_grad, got[4:]):
        assert (dp is not None) == wants
    for index in range(4):
        assert torch.equal(got[index], reference[index])
        assert _relative(got[index], math[index]) < 1e-10
    for index, wants in zip((4, 5), prefix_grad):
        if wants:
            assert _relative(got[index], math[index]) < 1e-10


CP_SPLITS = ((17, 12), (29, 0), (14, 14))  # each rank's page rows: uneven; all on rank 0; even


def _cp_page_inputs(split):
    return _attention_inputs(torch.Generator().manual_seed(split[0]), 7, 2, 6, 2, 8, sum(split))


def _cp_page_worker():
    """On each of 2 CP ranks: ``cp_prefix_causal_attention`` over this rank's share of the pages
    (requiring grad; blocks of 5), per split of ``CP_SPLITS``: the output and the gradients of q,
    k, v and of this rank's pages."""
    from megatron.core import parallel_state

    from megatron_longstraw.attention.cp_attention import cp_prefix_causal_attention
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed

    torch.set_num_threads(1)
    init_distributed(ParallelSizes(context=2), seed=1234)
    group = parallel_state.get_context_parallel_group()
    rank = parallel_state.get_context_parallel_rank()
    out = []
    for split in CP_SPLITS:
        q, k, v, pk, pv, grad = _cp_page_inputs(split)
        rows = slice(sum(split[:rank]), sum(split[:rank + 1]))
        pages_k, pages_v = (t.detach()[rows].clone().requires_grad_() for t in (pk, pv))
        result = cp_prefix_causal_attention(q, k, v, pages_k, pages_v, None, group, KernelOptions(prefix_block=5))
        out.append((rows, result.detach(), *torch.autograd.grad(result, (q, k, v, pages_k, pages_v), grad)))
    return out


def test_cp2_page_gradients_match_cp1():
    """CP=2 (gloo) with pages that require grad: every rank's output and q, k, v gradients are
    the CP=1 (one softmax) ones, and its pages' gradient is the CP=1 gradient of those rows."""
    from megatron_longstraw.testing.multiprocess import run_multiprocess

    ranks = run_multiprocess(_cp_page_worker, 2)
    for index, split in enumerate(CP_SPLITS):
        q, k, v, pk, pv, grad = _cp_page_inputs(split)
        out = prefix_causal_attention_math(q, k, v, pk, pv)
        want = (out, *torch.autograd.grad(out, (q, k, v, pk, pv), grad))
        for rank, run in enumerate(ranks):
            rows, *got = run[index]
            assert got[4].shape[0] == rows.stop - rows.start == split[rank]
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                assert _relative(a, b) < 1e-10, (split, rank, name)
            if split[rank]:
                for name, a, b in zip(("dpk", "dpv"), got[4:], want[4:]):
                    assert _relative(a, b[rows]) < 1e-10, (split, rank, name)


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_fp32_queries_take_the_emulated_kernel(monkeypatch, backend):
    """Queries the fused kernels cannot take (fp32, fp64 here: cuDNN's and flash's SDPA are 16-bit) run
    the emulated kernel whatever ``--attention-backend`` says, as ``partials.kernel_settings``
    decides for every other caller: the kernels called are recorded, and the output is the math
    path's."""
    import megatron_longstraw.attention.prefix_attention_cuda as cuda

    called = []
    forward = cuda.kernel_forward

    def recording(kernel, *args):
        called.append(kernel)
        return forward(kernel, *args)

    monkeypatch.setattr(cuda, "kernel_forward", recording)
    gen = torch.Generator().manual_seed(5)
    q, k, v, pk, pv, _ = _attention_inputs(gen, 5, 2, 4, 2, 8, 12, (False, False))
    got = prefix_causal_attention_cuda(q, k, v, pk, pv, options=KernelOptions(attention_backend=backend, prefix_block=8))
    assert called and set(called) == {"emulated"}, called
    torch.testing.assert_close(got, prefix_causal_attention_math(q, k, v, pk, pv), rtol=1e-5, atol=1e-6)
