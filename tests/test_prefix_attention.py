"""The GPU prefix-attention logic (folding, prefix blocks, LSE merge, merged-LSE backward) on CPU.

``KernelOptions(attention_backend="emulated")`` runs the fused-kernel interface in plain torch, so what
is checked here is the orchestration in ``prefix_attention_cuda``; the kernels themselves are
checked on the GPU host (``tests/gpu/test_longstraw_gpu.py``).
"""

import functools

import pytest
import torch

from megatron_longstraw.attention.kernel_options import KernelOptions
from megatron_longstraw.attention.prefix_attention import prefix_causal_attention_math
from megatron_longstraw.attention.prefix_attention_cuda import prefix_causal_attention_cuda


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
