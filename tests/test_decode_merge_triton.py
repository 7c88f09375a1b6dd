"""The Triton kernel of a decode query over its own keys merged with the pages' partials
(``attention/decode_merge_triton.py``), run by Triton's CPU interpreter, against the torch path
of ``decode_attention`` and against fp64 math."""

from megatron_longstraw.testing.triton_interpreter import run_interpreted

_INTERPRETED_KERNEL = """
from megatron_longstraw.testing.triton_interpreter import patch_loop_bounds
patch_loop_bounds()
import torch
from megatron_longstraw.attention import decode_attention as da
from megatron_longstraw.attention.decode_merge_triton import decode_merge
from megatron_longstraw.attention.prefix_attention import prefix_causal_attention_math
from megatron_longstraw.config.kernels import KernelOptions

gen = torch.Generator().manual_seed(0)


def rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


checked = 0
for dtype, bound in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
    # (batch, heads, groups, dim, dim_v, rows, valid, prompt, split): own rows over one and several
    # blocks of 32, a valid count below the rows, pages in whole splits and a rest, whole splits
    # only, a rest only, no pages; a head dim not a power of two; one group per head
    for batch, heads, groups, dim, dim_v, rows, valid, prompt, split in (
            (3, 4, 2, 32, 32, 37, 37, 70, 16), (2, 4, 2, 32, 32, 64, 33, 64, 16), (1, 2, 2, 24, 24, 5, 3, 9, 16),
            (2, 4, 1, 32, 16, 1, 1, 0, 16), (2, 2, 2, 16, 16, 40, 1, 20, 8)):
        rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
        q, k, v = rand(1, batch, heads, dim), rand(rows, batch, groups, dim), rand(rows, batch, groups, dim_v)
        k[valid:] = float("nan")  # masked rows: their content must not matter
        v[valid:] = float("nan")
        pk, pv = rand(prompt, 1, groups, dim), rand(prompt, 1, groups, dim_v)
        options = KernelOptions(decode_split_keys=split)
        own_valid = torch.tensor([valid]) if valid < rows else None
        stacks = da._prompt_stacks(q, pk, pv, 0.3, options) if prompt else []
        got = decode_merge(q[0], k, v, 0.3, own_valid, stacks)
        assert got.dtype == dtype and got.shape == (batch, heads, dim_v)
        ref_pk = torch.cat([pk.expand(-1, batch, -1, -1), k[: valid - 1]]).double()
        ref_pv = torch.cat([pv.expand(-1, batch, -1, -1), v[: valid - 1]]).double()
        want = prefix_causal_attention_math(q.double(), k[valid - 1: valid].double(), v[valid - 1: valid].double(),
                                            ref_pk, ref_pv, scale=0.3)[0]
        assert rel(got, want) <= bound, ("math", dtype, batch, rows, valid, prompt, rel(got, want))
        # the torch path multiplies masked rows by 0: their buffers hold zeros there (decode_state)
        k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
        torch_path = da.decode_attention(q, k, v, pk if prompt else None, pv if prompt else None, 0.3,
                                         options=options, own_valid=own_valid)[0]
        assert rel(got, torch_path.double()) <= bound, ("torch path", dtype, rows, prompt)
        checked += 1
assert checked == 10
print("ok")
"""


def test_decode_merge_kernel_in_triton_interpreter():
    """fp32 within 1e-5 of fp64 math and of ``decode_attention``'s torch path (fp16: 2e-3, its
    output rounding), with NaN in the masked own rows, a valid count below the rows, the pages
    in whole splits and a rest, one of the two, or none, a head dim that is not a power of two."""
    result = run_interpreted(_INTERPRETED_KERNEL)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
