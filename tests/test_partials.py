"""Attention partials (``attention/partials.py``) against one softmax over all keys in fp64: the
two-way merge over disjoint key sets, the empty partial (``out = 0``, ``lse = -inf``) on one side
and on both sides of a merge with finite, correct values and gradients (DSA's partial over a
page set included), and the merge over a process group (two gloo processes) with and without
autograd."""

import math

import torch

from megatron_longstraw.attention.dsa_blockwise import sparse_latent_partial
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.attention.partials import (
    merge_stacked_partials,
    default_scale, empty_partial, expand_groups, kernel_settings, merge_partials, merge_partials_over_group,
    merge_partials_over_group_with_grad, softmax_partial)
from megatron_longstraw.testing.multiprocess import run_multiprocess

ROWS, KEYS, DIM = 6, 10, 3
INF = float("-inf")


def _inputs(seed):
    """fp64 scores ``[rows, keys]`` and values ``[keys, d]`` with gradients, and the key set of
    each (row, key): 0, 1 or 2, or -1 (the row does not see the key). Row 0 sees no key at all,
    row 1 all of its keys in set 0 (sets 1 and 2 empty), row 2 none in set 1."""
    gen = torch.Generator().manual_seed(seed)
    scores = (3 * torch.randn(ROWS, KEYS, generator=gen, dtype=torch.float64)).requires_grad_()
    values = torch.randn(KEYS, DIM, generator=gen, dtype=torch.float64).requires_grad_()
    sets = torch.randint(-1, 3, (ROWS, KEYS), generator=gen)
    sets[0] = -1
    sets[1] = torch.where(sets[1] >= 0, 0, -1)
    sets[2] = torch.where(sets[2] == 1, 2, sets[2])
    sets[3:, 0] = 1  # every other row sees key 0, in set 1
    return scores, values, sets


def _one_softmax(scores, values, visible):
    """Reference: the softmax over the visible keys of each row, ``(out, lse)``; a row with no
    visible key is the empty partial, written out by hand."""
    seen = visible.any(-1)
    probs = torch.where(visible, scores, INF)[seen].softmax(-1)
    out = torch.zeros(ROWS, DIM, dtype=scores.dtype).index_put((seen.nonzero()[:, 0],), probs @ values)
    lse = torch.full((ROWS,), INF, dtype=scores.dtype).index_put((seen.nonzero()[:, 0],),
                                                                  torch.where(visible, scores, INF)[seen].logsumexp(-1))
    return out, lse


def _partial(scores, values, visible):
    probs, lse = softmax_partial(scores.masked_fill(~visible, INF))
    return probs @ values, lse


def _loss(out, lse, seed):
    """A weighted sum of the outputs and of the finite log-sum-exps (``-inf`` rows left out)."""
    gen = torch.Generator().manual_seed(seed)
    weights_out = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    weights_lse = torch.randn(lse.shape, generator=gen, dtype=lse.dtype)
    return (out * weights_out).sum() + (lse.masked_fill(lse == INF, 0.0) * weights_lse).sum()


def _value_and_grads(fn, scores, values, seed=7):
    out, lse = fn()
    return (out, lse, *torch.autograd.grad(_loss(out, lse, seed), (scores, values)))


def test_merge_of_partials_equals_one_softmax():
    """Three disjoint key sets merged two at a time equal one softmax over their union: output,
    log-sum-exp and the gradients of the scores and values, with rows where some or all sets are
    empty."""
    for seed in range(3):
        scores, values, sets = _inputs(seed)

        def merged():
            parts = [_partial(scores, values, sets == s) for s in range(3)]
            return merge_partials(*merge_partials(*parts[0], *parts[1]), *parts[2])

        got = _value_and_grads(merged, scores, values)
        want = _value_and_grads(lambda: _one_softmax(scores, values, sets >= 0), scores, values)
        for name, a, b in zip(("out", "lse", "d_scores", "d_values"), got, want):
            assert torch.equal(a.isinf(), b.isinf()) and not a.isnan().any(), (name, seed)
            finite = ~b.isinf()
            assert (a[finite] - b[finite]).abs().max().item() < 1e-12, (name, seed)
        assert got[1][0].item() == INF and torch.equal(got[0][0], torch.zeros(DIM, dtype=torch.float64))


def test_stacked_merge_equals_one_softmax():
    """Three disjoint key sets stacked and merged at once equal one softmax over their union, with
    rows where some or all sets are empty (the all-empty row: the empty partial, no NaN)."""
    for seed in range(3):
        scores, values, sets = _inputs(seed)
        with torch.no_grad():
            parts = [_partial(scores, values, sets == s) for s in range(3)]
            out, lse = merge_stacked_partials(torch.stack([o for o, _ in parts]), torch.stack([lse_ for _, lse_ in parts]))
            want_out, want_lse = _one_softmax(scores, values, sets >= 0)
        assert torch.equal(lse.isinf(), want_lse.isinf()) and not out.isnan().any()
        finite = ~want_lse.isinf()
        assert (lse[finite] - want_lse[finite]).abs().max().item() < 1e-12
        assert (out[finite] - want_out[finite]).abs().max().item() < 1e-12
        assert lse[0].item() == INF and torch.equal(out[0], torch.zeros(DIM, dtype=torch.float64))


def test_softmax_partial_of_a_row_with_no_visible_key_is_the_empty_partial():
    scores = torch.tensor([[1.0, INF, 2.0], [INF, INF, INF]], dtype=torch.float64, requires_grad=True)
    probs, lse = softmax_partial(scores)
    assert torch.equal(probs[1], torch.zeros(3, dtype=torch.float64)) and lse[1].item() == INF
    assert torch.allclose(probs[0], torch.tensor([1, 0, math.e], dtype=torch.float64) / (1 + math.e))
    assert abs(lse[0].item() - math.log(math.e + math.e ** 2)) < 1e-15
    (grad,) = torch.autograd.grad((probs * torch.arange(3.0, dtype=torch.float64)).sum() + lse[0], scores)
    assert torch.isfinite(grad).all() and torch.equal(grad[1], torch.zeros(3, dtype=torch.float64))


def test_merge_with_empty_sides_stays_finite():
    """One side empty: the merge is the other side, whose gradients pass through unchanged, and the
    empty side gets zero gradients. Both sides empty: the empty partial, all gradients zero and
    finite (``torch.logaddexp`` would give NaN gradients there)."""
    gen = torch.Generator().manual_seed(3)
    out = torch.randn(4, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    lse = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out, grad_lse = torch.randn(4, DIM, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen,
                                                                                              dtype=torch.float64)
    for side in ("a", "b"):
        empty_out, empty_lse = (t.requires_grad_() for t in empty_partial((4, DIM), torch.float64, "cpu"))
        pair = (out, lse, empty_out, empty_lse) if side == "a" else (empty_out, empty_lse, out, lse)
        got_out, got_lse = merge_partials(*pair)
        assert torch.equal(got_out, out) and torch.equal(got_lse, lse), side
        grads = torch.autograd.grad((got_out * grad_out).sum() + (got_lse * grad_lse).sum(),
                                    (out, lse, empty_out, empty_lse))
        assert all(torch.isfinite(g).all() for g in grads), side
        assert torch.allclose(grads[0], grad_out, rtol=0, atol=1e-12), side
        assert torch.allclose(grads[1], grad_lse, rtol=0, atol=1e-12), side
        assert torch.equal(grads[2], torch.zeros_like(grads[2])) and torch.equal(grads[3], torch.zeros_like(lse))
    a_out, a_lse, b_out, b_lse = (t.requires_grad_() for t in (*empty_partial((4, DIM), torch.float64, "cpu"),
                                                               *empty_partial((4, DIM), torch.float64, "cpu")))
    got_out, got_lse = merge_partials(a_out, a_lse, b_out, b_lse)
    assert torch.equal(got_out, torch.zeros(4, DIM, dtype=torch.float64)) and bool((got_lse == INF).all())
    grads = torch.autograd.grad((got_out * grad_out).sum(), (a_out, a_lse, b_out, b_lse))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    # mixed dtypes (a 16-bit kernel output into an fp32 accumulator): the wider dtype
    merged_out, merged_lse = merge_partials(out.detach().float(), lse.detach().float(),
                                            out.detach().bfloat16(), lse.detach().float())
    assert merged_out.dtype == torch.float32 and merged_lse.dtype == torch.float32


def test_shared_settings():
    assert default_scale(None, 16) == 0.25 and default_scale(0.3, 16) == 0.3
    x = torch.arange(2 * 2 * 3 * 1.0).view(1, 2, 3, 2)  # [b, groups 2, s 3, d 2]
    assert expand_groups(x, 2) is x
    assert torch.equal(expand_groups(x, 6)[0, :, 0, 0], torch.tensor([0.0, 0, 0, 6, 6, 6]))
    options = KernelOptions(attention_backend="flash", prefix_block=9)
    assert kernel_settings(torch.zeros(1, dtype=torch.bfloat16), options) == ("emulated", 9)  # not on a GPU
    assert kernel_settings(torch.zeros(1), options) == ("emulated", 9)


def _group_merge_worker(seed):
    """Rank r holds key set r of ``_inputs``: its partial, merged over the group without and
    with autograd; the values and this rank's gradients (of its scores' entries in its set)."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed

    init_distributed(ParallelSizes(context=2), seed=1234)
    group = parallel_state.get_context_parallel_group()
    rank = dist.get_rank(group)
    scores, values, sets = _inputs(seed)
    sets = torch.where(sets == 2, 1, sets)  # two ranks: sets 0 and 1 (row 1 empty on rank 1)
    plain = merge_partials_over_group(*_partial(scores.detach(), values.detach(), sets == rank), group)
    graded = _value_and_grads(lambda: merge_partials_over_group_with_grad(*_partial(scores, values, sets == rank),
                                                                          group), scores, values)
    return dict(sets=sets, plain=plain, graded=graded)


def test_merge_over_a_group_equals_one_softmax():
    """Two gloo ranks, each with its key set (a row no rank sees, a row one rank sees): the
    merged values on both ranks equal one softmax; with autograd each rank's score gradients
    are the one softmax's on its own keys (the value gradients add up over the ranks)."""
    ranks = run_multiprocess(_group_merge_worker, 2, 1)
    sets = ranks[0]["sets"]
    scores, values, _ = _inputs(1)
    want = _value_and_grads(lambda: _one_softmax(scores, values, sets >= 0), scores, values)
    for rank, run in enumerate(ranks):
        for got in (run["plain"], run["graded"][:2]):
            for a, b in zip(got, want[:2]):
                assert torch.equal(a.isinf(), b.isinf()) and not a.isnan().any(), rank
                assert (a - b)[~b.isinf()].abs().max().item() < 1e-12, rank
        d_scores = run["graded"][2]
        assert torch.isfinite(d_scores).all() and not d_scores[sets != rank].any(), rank
        assert (d_scores - want[2])[sets == rank].abs().max().item() < 1e-12, rank
    d_values = ranks[0]["graded"][3] + ranks[1]["graded"][3]
    assert (d_values - want[3]).abs().max().item() < 1e-12


def test_sparse_latent_partial_of_a_query_with_no_pick_here_is_empty_with_finite_gradients():
    """DSA's partial over one page set (``dsa_blockwise.sparse_latent_partial``): a query whose
    picks all live elsewhere gets the empty partial, and with autograd every gradient stays
    finite, that query's and its share of the pages' zero; the other queries match a softmax over
    their picks written out by hand."""
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(3, 1, 2, 6, generator=gen, dtype=torch.float64, requires_grad=True)  # [s, b, n, w]
    pages = torch.randn(4, 1, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([10, 11, 12, 13])
    topk = torch.tensor([[[10, 12], [99, -1], [13, -1]]])  # query 1: no pick on these pages
    out, lse = sparse_latent_partial(query, pages, positions, topk, 0.5, 4)
    assert torch.equal(out[1], torch.zeros(1, 2, 4, dtype=torch.float64)) and bool((lse[1] == INF).all())
    for row, rows in ((0, [0, 2]), (2, [3])):
        scores = torch.einsum("nw,kw->nk", query[row, 0], pages[rows, 0]) * 0.5
        assert (out[row, 0] - scores.softmax(-1) @ pages[rows, 0, :4]).abs().max().item() < 1e-12
        assert (lse[row, 0] - scores.logsumexp(-1)).abs().max().item() < 1e-12
    grads = torch.autograd.grad(_loss(out, lse, 3), (query, pages), retain_graph=True)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    empty_row = torch.autograd.grad((out[1] * torch.randn(out[1].shape, generator=gen, dtype=torch.float64)).sum(),
                                    (query, pages))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in empty_row)  # nothing reaches back from it
