"""Rollouts from a CP-sharded prompt state (Qwen3.5: full attention + Gated DeltaNet): CP=2 (two
gloo processes, fp32) against CP=1 and the full forward. Greedy and seeded sampling give the same
tokens as CP=1 on both CP ranks (rank 1's generator is seeded differently on purpose: CP rank 0's
tokens are broadcast), per-step logits within 1e-5, EOS drops samples the same way, the prompt
pages stay shared (per-sample state as at CP=1) and each rank's prompt state holds ~1/2 of the
pages. One spawn runs every case."""

import pytest
import torch

from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.multiprocess import run_multiprocess

PRESET = "qwen3.5-debug"
# (prompt length, chunk size): one chunk (shards 23 | 22) and chunks of 16 (8|8, 8|8, 7|6)
CASES = [(45, 64), (45, 16)]
NEW, SAMPLES, SEED = 7, 3, 7
TEMPERATURES = (0.0, 1.0)


def _model(hf, kernels=KernelOptions()):
    from megatron_longstraw.models.options import ModelOptions
    from megatron_longstraw.testing.hf_reference import build_hf_model
    from megatron_longstraw.testing.parity import megatron_from_hf

    return megatron_from_hf(hf, build_hf_model(hf, seed=0),
                            ModelOptions(params_dtype=torch.float32, kernel_options=kernels))


def _prompt(hf, n, seed=1):
    return torch.randint(0, hf["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _run(hf, seed, kernels=KernelOptions()):
    """Per case and temperature: responses, step logits, per-sample state bytes; then the prompt
    state bytes and an EOS run (EOS = the second sample's third sampled token). ``kernels``: the
    attention kernels' options."""
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.rollout.generate import generate_from_state

    model = _model(hf, kernels)
    out = {}
    with torch.no_grad():
        for length, chunk in CASES:
            state = capture_prompt(model, _prompt(hf, length), chunk)
            case = {"state_bytes": state.nbytes(),
                    "page_bytes": sum(t.numel() * t.element_size() for layer in state.layers.values()
                                      for f, t in layer.tensors().items() if f in ("key_SBGD", "value_SBGD"))}
            for temperature in TEMPERATURES:
                result = generate_from_state(model, state, SAMPLES, NEW, temperature=temperature,
                                             generator=torch.Generator().manual_seed(seed), keep_logits=True)
                case[temperature] = dict(responses=result.responses, logits=result.step_logits,
                                         decode_bytes=result.decode_state_bytes)
            eos = int(case[1.0]["responses"][1][2])
            result = generate_from_state(model, state, SAMPLES, NEW, temperature=1.0, eos_id=eos,
                                         generator=torch.Generator().manual_seed(seed), keep_logits=True)
            case["eos"] = dict(responses=result.responses, logits=result.step_logits,
                               stopped=result.stopped_by_eos)
            out[length, chunk] = case
    return out


def _cp_worker(hf):
    from megatron.core import parallel_state

    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed

    torch.set_num_threads(1)  # two ranks on a small CPU
    init_distributed(ParallelSizes(context=2), seed=1234)
    rank = parallel_state.get_context_parallel_rank()
    # a different generator on CP rank 1: CP rank 0's tokens are broadcast, so rank 1's draws
    # must not matter; each rank's pages in several blocks of 5 keys
    return {"cp_rank": rank, "runs": _run(hf, SEED + 1000 * rank, KernelOptions(prefix_block=5))}


@pytest.fixture(scope="module")
def runs():
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import destroy_distributed, init_distributed
    from megatron_longstraw.testing.parity import forward_logits

    hf = resolve_hf_config(PRESET)
    init_distributed(ParallelSizes(), seed=1234)
    try:
        reference = _run(hf, SEED)
        model = _model(hf)
        full = {}  # full forward of prompt + each greedy response (CP=1)
        with torch.no_grad():
            for length, chunk in CASES:
                prompt = _prompt(hf, length)
                full[length, chunk] = [
                    forward_logits(model, torch.cat([prompt, r[None]], dim=1))[0, length - 1:-1]
                    for r in reference[length, chunk][0.0]["responses"]]
    finally:
        destroy_distributed()
    return reference, full, run_multiprocess(_cp_worker, 2, hf)


@pytest.mark.parametrize("case", CASES, ids=[f"P{p}-chunk{c}" for p, c in CASES])
@pytest.mark.parametrize("temperature", TEMPERATURES + ("eos",), ids=["greedy", "sampled", "eos"])
def test_cp2_rollouts_equal_cp1(runs, case, temperature):
    reference, full, ranks = runs
    ref = reference[case][temperature]
    assert ranks[0]["cp_rank"] == 0 and ranks[1]["cp_rank"] == 1
    if temperature == "eos":
        assert any(ref["stopped"]) and min(r.numel() for r in ref["responses"]) < NEW
    for rank, run in enumerate(ranks):
        got = run["runs"][case][temperature]
        assert [r.tolist() for r in got["responses"]] == [r.tolist() for r in ref["responses"]], rank
        if temperature == "eos":
            assert got["stopped"] == ref["stopped"]
        for logits, want in zip(got["logits"], ref["logits"]):
            diff = (logits - want).abs().max().item()
            assert diff <= 1e-5, f"rank {rank}: max abs step-logit diff {diff}"
        if temperature == 0.0:
            for logits, want in zip(got["logits"], full[case]):
                assert (logits - want).abs().max().item() <= 1e-5
    # the generated tokens are replicated across the CP ranks
    for a, b in zip(ranks[0]["runs"][case][temperature]["responses"],
                    ranks[1]["runs"][case][temperature]["responses"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", CASES, ids=[f"P{p}-chunk{c}" for p, c in CASES])
def test_cp2_prompt_pages_sharded_and_shared(runs, case):
    """Each rank keeps its shard of the pages (~1/2, at most one extra row per chunk); decoding
    allocates per sample exactly what it does at CP=1 (the pages are shared, never copied)."""
    from megatron_longstraw.core.collectives import shard_plan

    reference, _, ranks = runs
    ref = reference[case]
    plan = shard_plan(case[0], case[1], 2)
    for rank, run in enumerate(ranks):
        got = run["runs"][case]
        rows = sum(sizes[rank] for _, sizes in plan)
        assert got["page_bytes"] * case[0] == ref["page_bytes"] * rows
        assert ref["state_bytes"] - got["state_bytes"] == ref["page_bytes"] - got["page_bytes"]
        assert rows <= case[0] // 2 + len(plan)
        for temperature in TEMPERATURES:
            assert got[temperature]["decode_bytes"] == ref[temperature]["decode_bytes"]
