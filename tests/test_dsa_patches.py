"""The DSA patches: a causal top-k tie rule and DSA math that never narrows fp64."""

import torch

from megatron_longstraw import patches


def _dsa():
    from megatron.core.transformer.experimental_attention_variant import dsa

    return dsa


def _causal_bounds(length):
    return torch.zeros(length, dtype=torch.int64), torch.arange(1, length + 1)


def test_dsa_top_k_breaks_exact_ties_by_position_whatever_follows():
    """ReLU scoring makes most scores exactly 0: the selection among them is the lowest
    positions, and a query's selection does not change when more (masked) tokens follow."""
    patches.apply_patches()
    generator = torch.Generator().manual_seed(0)
    length, dim, heads, topk = 48, 8, 2, 6
    query = torch.rand(length, 1, heads, dim, generator=generator)
    keys = -torch.rand(length, 1, dim, generator=generator)  # q.k < 0: relu -> exactly 0
    positive = torch.tensor([3, 17, 30])
    keys[positive] = -keys[positive]
    weights = torch.rand(length, 1, heads, generator=generator)
    selections = {}
    for n in (20, 35, length):
        starts, ends = _causal_bounds(n)
        _, indices = _dsa().fused_qk_topk_naive(query[:n], keys[:n], weights[:n], topk,
                                                varlen_starts=starts, varlen_ends=ends)
        selections[n] = indices[0].sort(-1).values
    for n in (20, 35):
        assert torch.equal(selections[n], selections[length][:n])
    row = 40  # positives 3, 17, 30 visible, then the lowest-position zeros 0, 1, 2
    assert selections[length][row].tolist() == [0, 1, 2, 3, 17, 30]


def test_dsa_math_keeps_fp64_and_is_unchanged_below():
    patches.apply_patches()
    generator = torch.Generator().manual_seed(1)
    q, k, w = torch.randn(5, 1, 2, 4, generator=generator), torch.randn(7, 1, 4, generator=generator), \
        torch.randn(5, 1, 2, generator=generator)
    assert _dsa()._compute_index_scores(q.double(), w.double(), k.double()).dtype == torch.float64
    patches._module("dsa_promote_precision").revert()
    try:
        original = _dsa()._compute_index_scores(q.bfloat16(), w.bfloat16(), k.bfloat16())
    finally:
        patches._module("dsa_promote_precision").apply()
    promoted = _dsa()._compute_index_scores(q.bfloat16(), w.bfloat16(), k.bfloat16())
    assert original.dtype == promoted.dtype == torch.float32 and torch.equal(original, promoted)

    # absorbed sparse attention in fp64 equals an fp64 dense reference with the same selection
    seq, heads, latent, rope = 6, 3, 8, 4
    query = torch.randn(seq, 1, heads, latent + rope, generator=generator, dtype=torch.float64)
    key = torch.randn(seq, 1, 1, latent + rope, generator=generator, dtype=torch.float64)
    topk = torch.tensor([[0, 1, -1], [0, 1, -1], [0, 2, -1], [1, 3, -1], [2, 4, 0], [5, 3, 1]])[None]
    starts, ends = _causal_bounds(seq)
    out = _dsa()._unfused_absorbed_dsa_fn(query, key, topk, 0.5, latent,
                                          varlen_starts=starts, varlen_ends=ends)
    assert out.dtype == torch.float64
    allowed = torch.zeros(seq, seq, dtype=torch.bool)
    for i, row in enumerate(topk[0]):
        allowed[i, row[(row >= 0) & (row <= i)]] = True
    scores = torch.einsum("shd,td->hst", query[:, 0], key[:, 0, 0]) * 0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    expected = torch.einsum("hst,tc->shc", probs, key[:, 0, 0, :latent])
    assert (out[:, 0] - expected).abs().max() <= 1e-12
