"""GPU tier: GLM-5's blockwise DSA on CUDA — the fused Triton index-score kernel in bf16, the
packed-int64 running top-k against the CPU path, and capture/replay of GLM-5 tiny in bf16."""

import pytest
import torch

from megatron_longstraw import patches
from megatron_longstraw.attention import dsa_blockwise
from megatron_longstraw.attention.dsa_blockwise import index_topk_blockwise
from megatron_longstraw.attention.index_scores_triton import index_scores, supported
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.replay import replay_logits
from megatron_longstraw.patches.dsa_causal_topk import dsa
from megatron_longstraw.testing.parity import bf16_and_fp32_models, forward_logits

pytestmark = pytest.mark.gpu


def test_fused_index_scores_match_megatron_bf16(record_property):
    """GLM-5's indexer shape (32 heads x 128): the kernel against ``_compute_index_scores`` on the
    same bf16 inputs (exact products, fp32 sums in another order), causal mask included."""
    patches.apply_patches()
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq, keys, heads, dim = 300, 5000, 32, 128
    q = torch.randn(seq, 1, heads, dim, device="cuda", generator=gen).bfloat16()
    w = torch.randn(seq, 1, heads, device="cuda", generator=gen).bfloat16()
    k = torch.randn(keys, 1, dim, device="cuda", generator=gen).bfloat16()
    assert supported(q, k)
    got = index_scores(q, w, k, 4900, 0, True)
    want = dsa._compute_index_scores(q, w, k, use_relu=True)
    future = torch.arange(keys, device="cuda")[None, :] > torch.arange(4900, 4900 + seq, device="cuda")[:, None]
    want = want.masked_fill(future, float("-inf"))
    assert torch.equal(got.isinf(), want.isinf())
    finite = ~want.isinf()
    error = ((got - want)[finite].abs().max() / want[finite].abs().max()).item()
    record_property("rel_err", f"{error:.1e}")
    assert error <= 1e-5


def test_cuda_blockwise_topk_equals_cpu_selection(monkeypatch):
    """Integer-valued bf16 inputs make every score exact on both paths: the CUDA path (Triton
    scores, packed-int64 top-k) selects exactly what the CPU path (Megatron's scores, the same
    packed selection over other block sizes) selects, ties included."""
    gen = torch.Generator().manual_seed(1)
    sample = lambda *shape: torch.randint(-2, 3, shape, generator=gen).bfloat16()  # noqa: E731
    prefix, seq, batch, heads, dim, topk = 3000, 700, 2, 8, 64, 256
    q, w, pages, own = sample(seq, batch, heads, dim), sample(seq, batch, heads), sample(prefix, 1, dim), \
        sample(seq, batch, dim)
    want = index_topk_blockwise(q.float(), w.float(), [(pages.float(), 0), (own.float(), prefix)], prefix, topk, True)
    monkeypatch.setattr(dsa_blockwise, "KEY_BLOCK", 1000)
    got = index_topk_blockwise(q.cuda(), w.cuda(), [(pages.cuda(), 0), (own.cuda(), prefix)], prefix, topk, True)
    assert torch.equal(got.cpu(), want)


def test_glm_capture_replay_bf16_matches_full_forward(single_process, monkeypatch, record_property):
    """GLM-5 tiny in bf16 on CUDA (fused index scores, gathered sparse MLA, small DSA blocks):
    replay logits after a chunked capture against the bf16 full forward (Megatron's dense DSA),
    both against the fp32 full forward."""
    monkeypatch.setattr(dsa_blockwise, "KEY_BLOCK", 64)
    hf, model, model32 = bf16_and_fp32_models("glm-5-debug")
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, 700), device="cuda", generator=gen)
    response = torch.randint(0, hf["vocab_size"], (1, 90), device="cuda", generator=gen)
    sequence = torch.cat([prompt, response], 1)
    with torch.no_grad():
        truth = forward_logits(model32, sequence)[0, 699:-1]
        full = forward_logits(model, sequence)[0, 699:-1].float()
        replayed = replay_logits(model, capture_prompt(model, prompt, 256), response)[:, 0].float()
    scale = truth.abs().max()
    full_error = ((full - truth).abs().max() / scale).item()
    replay_error = ((replayed - truth).abs().max() / scale).item()
    record_property("rel_err_full_replay", f"{full_error:.1e},{replay_error:.1e}")
    assert replay_error <= max(2 * full_error, 2e-2)
