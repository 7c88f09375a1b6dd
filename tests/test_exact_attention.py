"""``testing/exact_attention.py``, the reference of the GPU tier's long-prompt FP8 checks, against
plain attention (``prefix_causal_attention_math``) in fp64: every row and a subset of rows, with
and without pages, key blocks that split the chunk and the pages, GQA."""

import pytest
import torch

from megatron_longstraw.attention.prefix_attention import prefix_causal_attention_math
from megatron_longstraw.testing.exact_attention import exact_chunk_attention


@pytest.mark.parametrize("pages,key_block", [(0, 4), (13, 5), (13, 1000)])
def test_exact_chunk_attention_matches_plain_attention(pages, key_block):
    gen = torch.Generator().manual_seed(pages + key_block)
    q = torch.randn(9, 1, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(9, 1, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    pk, pv = (torch.randn(pages, 1, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    want = prefix_causal_attention_math(q, k, v, pk if pages else None, pv if pages else None)
    got = exact_chunk_attention(q, k, v, pk if pages else None, pv if pages else None, key_block=key_block)
    assert got.shape == want.shape and got.dtype == torch.float64
    assert (got - want).abs().max().item() < 1e-12
    rows = [0, 4, 8]
    some = exact_chunk_attention(q, k, v, pk if pages else None, pv if pages else None, rows=rows, key_block=key_block)
    assert (some - want[rows]).abs().max().item() < 1e-12
