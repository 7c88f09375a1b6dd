"""GLM-5's DSA in blocks (``attention/dsa_blockwise.py``) against Megatron's dense reference:
the blockwise indexer top-k selects exactly what the unchunked top-k selects (same indices, same
tie order), and blockwise sparse MLA gives the dense masked attention's output and gradients."""

import pytest
import torch
from megatron.core.transformer.experimental_attention_variant.dsa import _run_sparse_attention

from megatron_longstraw import patches
from megatron_longstraw.attention.cp_sparse_attention import up_project
from megatron_longstraw.attention.dsa_blockwise import index_topk_blockwise, sparse_latent_attention
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.patches.dsa_causal_topk import dsa, fused_qk_topk_causal
from megatron_longstraw.testing.parity import max_rel_error
from megatron_longstraw.testing.triton_interpreter import run_interpreted

HEADS, DIM = 4, 16


def _indexer_inputs(prefix, seq, batch, seed, ties):
    """Gaussian inputs, or with ``ties`` small integers: every score is then an exact integer
    whatever the summation order, and equal scores (exact ties) are everywhere."""
    gen = torch.Generator().manual_seed(seed)
    sample = ((lambda *shape: torch.randint(-2, 3, shape, generator=gen).float()) if ties
              else (lambda *shape: torch.randn(*shape, generator=gen)))
    return (sample(seq, batch, HEADS, DIM), sample(seq, batch, HEADS), sample(prefix, 1, DIM),
            sample(seq, batch, DIM))


def _unchunked_topk(q_SBHD, weights_SBH, prefix_P1D, own_SBD, k, use_relu):
    """The whole ``[queries, prefix + own]`` score matrix at once (the single-rank selection)."""
    prefix, seq, batch = prefix_P1D.shape[0], own_SBD.shape[0], own_SBD.shape[1]
    keys = torch.cat([prefix_P1D.expand(prefix, batch, -1), own_SBD])
    ends = torch.arange(prefix + 1, prefix + seq + 1)
    return fused_qk_topk_causal(q_SBHD, keys, weights_SBH, k, varlen_starts=torch.zeros(seq, dtype=torch.int64),
                                varlen_ends=ends, use_relu=use_relu)[1]


@pytest.mark.parametrize("key_block,score_elements", [(8, 1 << 30), (7, 1 << 30), (1, 4 * HEADS * 5),
                                                       (5, 4 * HEADS * 5), (4096, 1 << 27)])
@pytest.mark.parametrize("use_relu,ties", [(True, False), (False, False), (True, True), (False, True)])
@pytest.mark.parametrize("dtype,topk_keys", [(torch.float32, "packed"), (torch.float32, "float"),
                                              (torch.float64, "packed")])
def test_blockwise_topk_equals_unchunked(key_block, score_elements, use_relu, ties, dtype, topk_keys):
    """Key blocks that divide the 40-token prefix (8) and do not (7, 5, 1), query blocks of 5
    rows, ReLU scoring (many exact zeros) and duplicated keys (exact ties): identical indices,
    in the same order; a top-k wider than the visible keys pads with -1 like the reference. fp32
    scores take the packed-int64 selection (every score packed, or with ``--dsa-topk float``
    the block's fp32 top-k first, packed ranking only for a block whose cut falls in a tie), fp64
    the stable-sort one.
    (Gaussian scores from GEMMs of other shapes may differ in the last bit; the tie cases use
    integer inputs, whose scores are exact, so a tie is a tie in both.)"""
    patches.apply_patches()
    options = KernelOptions(dsa_key_block=key_block, dsa_score_elements=score_elements, dsa_topk=topk_keys)
    decided = False
    for prefix, seq, batch, k, seed in ((40, 13, 2, 6, 0), (40, 13, 1, 60, 1), (0, 9, 2, 4, 2), (33, 1, 3, 8, 3)):
        inputs = [t.to(dtype) for t in _indexer_inputs(prefix, seq, batch, seed, ties)]
        want = _unchunked_topk(*inputs, k, use_relu)
        q, w, prefix_P1D, own = inputs
        got = index_topk_blockwise(q, w, [(prefix_P1D, 0), (own, prefix)], prefix, k, use_relu, options)
        assert got.shape == want.shape == (batch, seq, min(k, prefix + seq))
        assert torch.equal(got, want), (prefix, seq, batch, k)
        decided = decided or (ties and _tie_decided(q, w, prefix_P1D, own, want, use_relu))
    # the tie rule did decide: some selected score equals the score of a visible key left out
    assert decided == ties


def _tie_decided(q_SBHD, weights_SBH, prefix_P1D, own_SBD, topk_BSK, use_relu) -> bool:
    prefix, seq, batch = prefix_P1D.shape[0], own_SBD.shape[0], own_SBD.shape[1]
    keys = torch.cat([prefix_P1D.expand(prefix, batch, -1), own_SBD])
    scores = torch.einsum("sbhd,tbd->sbht", q_SBHD, keys)
    scores = (scores.relu() if use_relu else scores).mul(weights_SBH[..., None]).sum(2).transpose(0, 1)
    visible = torch.ones(seq, prefix + seq, dtype=torch.bool).tril(prefix)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, topk_BSK.clamp_min(0), True)
    lowest = scores.masked_fill(~chosen, float("inf")).amin(-1, keepdim=True)
    return bool(((scores == lowest) & visible & ~chosen).any())


def _attention_inputs(prefix, seq, batch, topk, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    heads, rank, rope, v_head = 3, 12, 4, 5
    query = torch.randn(seq, batch, heads, rank + rope, generator=gen, dtype=dtype, requires_grad=True)
    own = torch.randn(seq, batch, rank + rope, generator=gen, dtype=dtype, requires_grad=True)
    prefix_P1K = torch.randn(prefix, 1, rank + rope, generator=gen, dtype=dtype)
    up_v = torch.randn(heads, v_head, rank, generator=gen, dtype=dtype)
    index = torch.randn(seq, batch, 2, 6, generator=gen, dtype=dtype)
    weights = torch.randn(seq, batch, 2, generator=gen, dtype=dtype)
    keys_index = torch.randn(prefix + seq, 1, 6, generator=gen, dtype=dtype)
    topk = _unchunked_topk(index.float(), weights.float(), keys_index[:prefix].float(),
                           keys_index[prefix:].expand(seq, batch, 6).float(), topk, True)
    return query, own, prefix_P1K, up_v, topk, rank


def _dense_reference(query, own, prefix_P1K, up_v, topk, rank, config):
    prefix, seq, batch = prefix_P1K.shape[0], own.shape[0], own.shape[1]
    keys = torch.cat([prefix_P1K.expand(prefix, batch, -1), own]).unsqueeze(2)
    return _run_sparse_attention(absorbed_mla=True, query=query, key=keys, value=None, up_v_weight=up_v,
                                 topk_indices=topk, softmax_scale=0.3, config=config, mask=None,
                                 varlen_starts=torch.zeros(seq, dtype=torch.int64),
                                 varlen_ends=torch.arange(prefix + 1, prefix + seq + 1), key_positions=None)


@pytest.mark.parametrize("gather_elements", [1 << 27, 1, 300])
def test_sparse_latent_attention_matches_dense_masked(gather_elements):
    """Output and gradients (queries, own latents) equal Megatron's dense masked absorbed DSA in
    fp64 (and fp32 to 1e-5), in one query block, one query per block, and a few per block;
    top-k smaller than, and wider than, the visible keys."""
    from types import SimpleNamespace

    patches.apply_patches()
    options = KernelOptions(dsa_gather_elements=gather_elements)
    for dtype, bound in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        for prefix, seq, batch, topk, seed in ((29, 11, 2, 5, 0), (6, 7, 1, 40, 1), (0, 5, 2, 3, 2)):
            query, own, prefix_P1K, up_v, topk_BSK, rank = _attention_inputs(prefix, seq, batch, topk, seed, dtype)
            config = SimpleNamespace(kv_lora_rank=rank, attention_backend="unfused")
            grad = torch.randn(seq, batch, up_v.shape[0] * up_v.shape[1], dtype=dtype,
                               generator=torch.Generator().manual_seed(seed + 10))
            results = []
            for run in (lambda: _dense_reference(query, own, prefix_P1K, up_v, topk_BSK, rank, config),
                        lambda: up_project(sparse_latent_attention(query, [(prefix_P1K, 0), (own, prefix)],
                                                                   topk_BSK, 0.3, rank, options), up_v)):
                out = run()
                results.append((out, *torch.autograd.grad(out, (query, own), grad)))
            for name, got, want in zip(("out", "d_query", "d_own"), results[1], results[0]):
                assert max_rel_error(got, want) <= bound, (name, dtype, prefix, seq)


def test_glm_capture_and_replay_run_in_bounded_blocks(single_process, monkeypatch):
    """GLM-5 tiny, prompt of 45 tokens in chunks of 16, DSA blocks of 5 keys: the MoE layers see
    one chunk's tokens at a time (routing and dispatch of the chunk only), no index-score tensor
    exceeds one block, and capture + replay still equal the full forward's logits."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.replay import replay_logits
    from megatron_longstraw.testing.parity import forward_logits, random_tokens, seeded_model

    hf = resolve_hf_config("glm-5-debug")
    chunk, block_elements = 16, 3 * hf["index_n_heads"] * 5
    model = seeded_model(hf, kernel_options=KernelOptions(dsa_key_block=5, dsa_score_elements=block_elements))
    prompt, response = random_tokens(hf, 45, 1), random_tokens(hf, 9, 2)
    with torch.no_grad():
        full = forward_logits(model, torch.cat([prompt, response], 1))[0, 44:-1]
    moe_tokens, score_sizes = [], []
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert moe_layers
    for layer in moe_layers:
        layer.register_forward_hook(lambda module, args, out: moe_tokens.append(args[0].shape[0]))
    original = dsa._compute_index_scores

    def spy(*args, **kwargs):
        scores = original(*args, **kwargs)
        score_sizes.append(scores.numel())
        return scores

    monkeypatch.setattr(dsa, "_compute_index_scores", spy)
    with torch.no_grad():
        state = capture_prompt(model, prompt, chunk)
        captured = list(moe_tokens)
        replayed = replay_logits(model, state, response)[:, 0]
    assert max(captured) == chunk and sum(captured) == 45 * len(moe_layers)
    assert score_sizes and max(score_sizes) <= 3 * 5  # [b=1, query block of 3, key block of 5]
    assert (replayed - full).abs().max().item() <= 1e-5


_INTERPRETED_KERNEL = """
import torch
from megatron_longstraw import patches
from megatron_longstraw.attention.index_scores_triton import index_scores
from megatron_longstraw.patches.dsa_causal_topk import dsa

patches.apply_patches()
gen = torch.Generator().manual_seed(0)
for seq, batch, key_batch, keys, query_start, key_start, relu in (
        (70, 1, 1, 130, 200, 100, True), (5, 2, 1, 9, 3, 0, False), (3, 2, 2, 70, 70, 7, True)):
    q = torch.randn(seq, batch, 4, 16, generator=gen).half()
    w = torch.randn(seq, batch, 4, generator=gen).half()
    k = torch.randn(keys, key_batch, 16, generator=gen).half()
    got = index_scores(q, w, k, query_start, key_start, relu)
    want = dsa._compute_index_scores(q, w, k.expand(keys, batch, 16), use_relu=relu)
    future = torch.arange(key_start, key_start + keys)[None, :] > torch.arange(query_start, query_start + seq)[:, None]
    want = want.masked_fill(future, float("-inf"))
    assert torch.equal(got.isinf(), want.isinf()) and future.any() and (~future).any()
    finite = ~want.isinf()
    error = ((got - want)[finite].abs().max() / want[finite].abs().max()).item()
    assert error <= 1e-5, error
print("ok")
"""


def test_fused_index_score_kernel_in_triton_interpreter():
    """The Triton index-score kernel, run by Triton's CPU interpreter, against Megatron's
    ``_compute_index_scores`` on the same fp16 inputs (exact products, fp32 sums in another
    order: 1e-5), with the causal mask at arbitrary query/key offsets and a shared key batch.
    (The interpreter reads bf16 as raw bits; bf16 runs in the GPU tier.)"""
    result = run_interpreted(_INTERPRETED_KERNEL)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
