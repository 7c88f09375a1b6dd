"""CP=2 (two gloo processes) against CP=1 for LongStraw capture/replay on Qwen3.5 and Qwen3.5-MoE
(full attention + Gated DeltaNet): response logits (fp32), per-parameter gradients after replay (fp64, see
``parity.logits_and_grads`` for why), the Gated DeltaNet state and the K/V pages after the
prompt, uneven prompts and chunks included; bad input. One spawn runs every case."""

import pytest
import torch

from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.multiprocess import on_one_rank, run_multiprocess
from megatron_longstraw.testing.parity import assert_grads_match, random_tokens, seeded_model, value_error_text

PRESETS = ("qwen3.5-debug", "qwen3.5-moe-debug")  # (the MoE layers route each rank's own tokens)
# (prompt length, chunk size): one chunk (plain contiguous shards 23 | 22), chunks of 16 that do
# not divide the odd prompt (8|8, 8|8, 7|6), and 2-token chunks (1|1 shards, shorter than the
# conv tail; the 1-token last chunk is folded into the one before)
CASES = [(45, 64), (45, 16), (7, 2)]
GRAD_CASE = (21, 8)  # 8|8, 3|2 shards
RESPONSES = (9, 4, 6)


def _nll(total_tokens):
    def loss_fn(logprobs_RB, mask_RB, indices):
        return -(logprobs_RB * mask_RB).sum() / total_tokens
    return loss_fn


def _run_cases(hf, kernels=KernelOptions()):
    """What both CP sizes compute (with the attention kernels' ``kernels`` options): per case the
    replay logits, the last prompt logits and the state's tensors; then fp64 replay gradients."""
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.replay import replay_logits, replay_responses

    model = seeded_model(hf, torch.float32, kernel_options=kernels)
    out = {"cases": {}}
    for length, chunk in CASES:
        prompt, response = random_tokens(hf, length, length), random_tokens(hf, 13, 100 + length)
        with torch.no_grad():
            state = capture_prompt(model, prompt, chunk)
            logits = replay_logits(model, state, response)[:, 0]
        out["cases"][length, chunk] = dict(
            logits=logits, last_logits=state.last_logits_BV[0], nbytes=state.nbytes(),
            layers={name: {f: t.clone() for f, t in s.tensors().items()} | {"length": getattr(s, "length", None)}
                    for name, s in state.layers.items()})
    model = seeded_model(hf, torch.float64, kernel_options=kernels)
    length, chunk = GRAD_CASE
    prompt = random_tokens(hf, length, 3)
    responses = [random_tokens(hf, n, 10 + n)[0] for n in RESPONSES]
    with torch.no_grad():
        state = capture_prompt(model, prompt, chunk)
    replay_responses(model, state, responses, _nll(sum(RESPONSES)), micro_batch_size=2)
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out


def _gdn_shard_errors(model, group):
    """One Gated DeltaNet layer's capture of a 23-token chunk split 12 | 11 over the CP ranks
    against its kernel over the whole chunk, from the same start state, with O(1) inputs (in
    the debug model the state's share of the output is small): relative errors of this rank's
    output rows and of the final state."""
    import torch.distributed as dist

    from megatron_longstraw.models.gated_delta_net import LongStrawGatedDeltaNet

    layer = next(m for m in model.modules() if isinstance(m, LongStrawGatedDeltaNet))
    gen = torch.Generator().manual_seed(5)
    seq, heads, dim_k, dim_v = 23, 2, 16, 8
    query, key = (torch.nn.functional.normalize(torch.randn(1, seq, heads, dim_k, generator=gen), dim=-1)
                  for _ in range(2))
    value = torch.randn(1, seq, heads, dim_v, generator=gen)
    g, beta = -0.1 * torch.rand(1, seq, heads, generator=gen), torch.rand(1, seq, heads, generator=gen)
    start = torch.randn(1, heads, dim_k, dim_v, generator=gen)
    want, want_final = layer.gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=start.clone(),
                                              output_final_state=True, use_qk_l2norm_in_kernel=False)
    rows = slice(0, 12) if dist.get_rank(group) == 0 else slice(12, seq)
    got, final = layer._capture_cp_delta_rule(query[:, rows], key[:, rows], value[:, rows], g[:, rows],
                                              beta[:, rows], start, group)
    return (((got - want[:, rows]).abs().max() / want[:, rows].abs().max()).item(),
            ((final - want_final).abs().max() / want_final.abs().max()).item())


def _cp_worker(hf):
    from megatron.core import parallel_state

    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.full_graph import full_graph_logits

    torch.set_num_threads(1)  # two ranks on a small CPU
    init_distributed(ParallelSizes(context=2), seed=1234)
    out = _run_cases(hf, KernelOptions(prefix_block=5))  # the page parts in several blocks (CP=1: one softmax)
    out["cp_rank"] = parallel_state.get_context_parallel_rank()
    model = seeded_model(hf, torch.float32)
    out["gdn_shards"] = _gdn_shard_errors(model, parallel_state.get_context_parallel_group())
    prompt = random_tokens(hf, 9, 0)
    out["bad"] = {
        "chunk": value_error_text(lambda: capture_prompt(model, prompt, 1)),
        "short": value_error_text(lambda: capture_prompt(model, prompt[:, :1], 4)),
        "full_graph": value_error_text(lambda: full_graph_logits(model, prompt, prompt[:, :3])),
    }
    return out


@pytest.fixture(scope="module", params=PRESETS)
def runs(request):
    hf = resolve_hf_config(request.param)
    return on_one_rank(_run_cases, hf), run_multiprocess(_cp_worker, 2, hf)


@pytest.mark.parametrize("case", CASES, ids=[f"P{p}-chunk{c}" for p, c in CASES])
def test_cp2_replay_logits_and_state_match_cp1(runs, case):
    reference, ranks = runs
    ref = reference["cases"][case]
    for rank, run in enumerate(ranks):
        got = run["cases"][case]
        diff = (got["logits"] - ref["logits"]).abs().max().item()
        assert diff <= 1e-5, f"rank {rank}: max abs logit diff {diff}"
        assert (got["last_logits"] - ref["last_logits"]).abs().max().item() <= 1e-5
        for name, layer in ref["layers"].items():
            if "recurrent_BHKV" in layer:  # Gated DeltaNet: the full state on every CP rank
                for field in ("recurrent_BHKV", "conv_tail_BCW"):
                    err = (got["layers"][name][field] - layer[field]).abs().max().item()
                    assert err <= 1e-5 * max(layer[field].abs().max().item(), 1.0), (rank, name, field, err)
    # full attention: the ranks' pages are the CP=1 pages, split between them, each rank ~1/CP
    from megatron_longstraw.core.collectives import shard_plan

    plan = shard_plan(case[0], case[1], 2)
    for name, layer in ref["layers"].items():
        if "key_SBGD" not in layer:
            continue
        for rank, run in enumerate(ranks):
            own = torch.cat([torch.arange(start + sum(sizes[:rank]), start + sum(sizes[:rank + 1]))
                             for start, sizes in plan])
            pages = run["cases"][case]["layers"][name]
            assert pages["length"] == len(own) <= case[0] // 2 + len(plan)
            for field in ("key_SBGD", "value_SBGD"):
                err = (pages[field] - layer[field][own]).abs().max().item()
                assert err <= 1e-5, (rank, name, field, err)


def test_cp2_state_bytes_scale_with_one_over_cp(runs):
    """The pages dominate a long prompt's state: per rank they are half of CP=1's (+ <= one row
    per chunk); the Gated DeltaNet state is replicated (constant size)."""
    reference, ranks = runs
    ref = reference["cases"][45, 64]
    page_bytes = sum(t.numel() * t.element_size() for layer in ref["layers"].values()
                     for f, t in layer.items() if f in ("key_SBGD", "value_SBGD"))
    for run in ranks:
        got = run["cases"][45, 64]
        saved = ref["nbytes"] - got["nbytes"]
        assert abs(saved - (page_bytes - page_bytes * (23 if run["cp_rank"] == 0 else 22) // 45)) == 0


def test_cp2_replay_gradients_match_cp1(runs):
    """Every CP rank holds the full CP=1 gradient (so Megatron's average over DP x CP keeps it)."""
    reference, ranks = runs
    for rank, run in enumerate(ranks):
        assert_grads_match(run["grads"], reference["grads"], 1e-5, f"rank {rank}")
    assert all(ref.abs().max() > 0 for ref in reference["grads"].values())


def test_cp2_gated_deltanet_shards_match_one_pass(runs):
    """The exact cross-shard recurrence: each rank's output rows and the final state equal one
    kernel pass over the whole chunk from the same (non-zero) start state."""
    _, ranks = runs
    for rank, run in enumerate(ranks):
        out_error, state_error = run["gdn_shards"]
        assert out_error <= 1e-5 and state_error <= 1e-5, (rank, out_error, state_error)


def test_cp2_bad_input_names_flag_or_layer_kind(runs):
    _, ranks = runs
    for run in ranks:
        bad = run["bad"]
        assert bad["chunk"] and "--prompt-chunk-size 1" in bad["chunk"] and "--context-parallel-size 2" in bad["chunk"]
        assert bad["short"] and "1 tokens" in bad["short"]
        assert bad["full_graph"] and "--replay-mode full" in bad["full_graph"]
