"""The forward-only Triton sparse-MLA kernel (``attention/sparse_mla_triton.py``), run by Triton's
CPU interpreter, against the torch path of ``attention/dsa_blockwise.py`` in fp64: the whole
sparse attention over two page tensors (the capture's prompt pages + the chunk's own latents)
and the CP partial (output and log-sum-exp over one rank's pages, queries with no pick there)."""

from megatron_longstraw.testing.triton_interpreter import run_interpreted

_INTERPRETED_KERNEL = """
from megatron_longstraw.testing.triton_interpreter import patch_loop_bounds
patch_loop_bounds()
import torch
from megatron_longstraw.attention.dsa_blockwise import sparse_latent_attention, sparse_latent_partial
from megatron_longstraw.attention.sparse_mla_triton import sparse_latent_forward

gen = torch.Generator().manual_seed(0)
V, R = 16, 16


def rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


for dtype, bound in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
    # heads 3 (padded to 16), picks 40 (32 + a partial block), pages of batch 1 and of batch 2
    for prefix, seq, batch, heads, picks, page_batch in ((50, 7, 2, 3, 40, 1), (0, 9, 1, 4, 5, 1), (20, 5, 2, 16, 33, 2)):
        query = torch.randn(seq, batch, heads, V + R, generator=gen).to(dtype)
        pages = torch.randn(prefix, page_batch, V + R, generator=gen).to(dtype)
        own = torch.randn(seq, batch, V + R, generator=gen).to(dtype)
        visible = torch.arange(prefix + 1, prefix + seq + 1)
        pick = lambda n: torch.nn.functional.pad(torch.randperm(n, generator=gen)[:picks], (0, max(0, picks - n)),
                                                 value=-1)
        topk = torch.stack([torch.stack([pick(int(n)) for n in visible]) for _ in range(batch)])
        topk[..., 2] = -1  # an empty slot mid-list
        topk[..., 0] = (prefix + torch.arange(seq))[None, :]  # every query sees itself
        segments = [(pages.double(), 0), (own.double(), prefix)]
        want = sparse_latent_attention(query.double(), segments, topk, 0.3, V)
        out, lse = sparse_latent_forward(query, [pages, own], topk, 0.3, V)
        error = rel(out, want)
        assert error <= bound, ("whole", dtype, prefix, error)

        if prefix == 0:
            continue
        # the CP partial over the prefix pages only, at scattered global positions
        positions = torch.arange(prefix) * 3 + 1
        here_topk = torch.where(topk < prefix, topk * 3 + 1, topk + 10**6)  # the own picks live elsewhere
        here_topk[:, 0] = 10**7  # query 0's picks: none here
        here_topk[:, 0, 1:] = -1
        want_out, want_lse = sparse_latent_partial(query.double(), pages.double(), positions, here_topk, 0.3, V)
        index = torch.searchsorted(positions, here_topk.clamp_min(0)).clamp_max(prefix - 1)
        here = (positions[index] == here_topk) & (here_topk >= 0)
        out, lse = sparse_latent_forward(query, [pages], torch.where(here, index, -1), 0.3, V)
        seen = here.any(-1).permute(1, 0)  # [s, b]
        assert (~seen).any() and seen.any()
        assert torch.equal(out[~seen], torch.zeros_like(out[~seen])) and bool((lse[~seen] == float("-inf")).all())
        assert torch.equal(want_out[~seen], torch.zeros_like(want_out[~seen]))
        assert bool((want_lse[~seen] == float("-inf")).all())
        assert rel(out[seen], want_out[seen]) <= bound, ("partial out", dtype, prefix)
        assert (lse[seen].double() - want_lse[seen]).abs().max().item() <= 10 * bound, ("partial lse", dtype)
print("ok")
"""


def test_sparse_mla_kernel_in_triton_interpreter():
    """fp32 (IEEE products) agrees with the fp64 torch path to 1e-5, fp16 to 3e-3 (its inputs and
    unnormalized probabilities are fp16): heads padded to the tensor-core tile, a partial last
    block of picks, empty (-1) slots, pages shared by the batch or per row, an empty prefix,
    and partial attention with queries that have no pick on these pages (the empty partial:
    out 0, lse -inf, on both paths)."""
    result = run_interpreted(_INTERPRETED_KERNEL)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
