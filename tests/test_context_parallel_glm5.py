"""CP=2 (two gloo processes) against CP=1 for LongStraw capture/replay and decoding on GLM-5 (MLA
latents + DSA indexer keys + MoE): the DSA top-k selections in capture and replay, response logits
(fp32), per-parameter gradients after replay (fp64), the latents and indexer keys per rank (each
rank's rows are CP=1's rows at its positions), uneven shards included; and rollouts decoded from
the CP-sharded state (greedy, seeded sampling, EOS): the same tokens, log-probabilities and
per-step top-k selections as CP=1 on both ranks. One spawn runs every case."""

import pytest
import torch

from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.multiprocess import on_one_rank, run_multiprocess
from megatron_longstraw.testing.parity import assert_grads_match, random_tokens, seeded_model, value_error_text

PRESET = "glm-5-debug"  # index_topk 8: prompts of 40+ tokens drop keys
# (prompt length, chunk size): one chunk (shards 23 | 22), and chunks of 16 that do not divide
# the prompt (8|8, 8|8, 7|6); no chunk is folded, so CP=1 and CP=2 capture the same chunks
CASES = [(45, 64), (45, 16)]
GRAD_CASE = (37, 16)
RESPONSES = (11, 6)
# rollouts (prompt length, chunk size): 8|8, 8|8, 7|6 over three chunks; and 2|1, rank 1's shard
# one token. With 10 new tokens the selection is sparse (more than index_topk = 8 visible keys:
# every query of the first case, the later ones of the second) and takes own keys beside the prompt's
ROLLOUT_CASES = [(45, 16), (3, 64)]
NEW, SAMPLES, SEED = 10, 3, 7
TEMPERATURES = (0.0, 1.0)


class _RecordTopk:
    """Records every top-k the DSA indexers' ``method`` returns (``topk``, every mode's: capture
    chunks, then replay; or decode steps)."""

    def __init__(self, method: str = "topk"):
        from megatron_longstraw.models.glm5.layers import LongStrawDSAIndexer

        self.cls, self.method, self.calls = LongStrawDSAIndexer, method, []
        self.original = getattr(LongStrawDSAIndexer, method)

    def __enter__(self):
        original, calls = self.original, self.calls

        def recording(module, x, qr):
            topk = original(module, x, qr)
            calls.append(topk.clone())
            return topk

        setattr(self.cls, self.method, recording)
        return self

    def __exit__(self, *exc):
        setattr(self.cls, self.method, self.original)


def _run_rollouts(hf, kernels, seed):
    """Per rollout case and temperature (and an EOS run: EOS = the second sample's third sampled
    token): responses, log-probabilities, step logits and every decode step's top-k."""
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.rollout.generate import generate_from_state

    model = seeded_model(hf, torch.float32, kernel_options=kernels)
    out = {}
    for length, chunk in ROLLOUT_CASES:
        with torch.no_grad():
            state = capture_prompt(model, random_tokens(hf, length, 20 + length), chunk)
        case = {}
        for temperature in TEMPERATURES + ("eos",):
            eos = None if temperature != "eos" else int(case[1.0]["responses"][1][2])
            with _RecordTopk() as topk:
                result = generate_from_state(model, state, SAMPLES, NEW, temperature=1.0 if eos else temperature,
                                             eos_id=eos, generator=torch.Generator().manual_seed(seed),
                                             keep_logits=True)
            case[temperature] = dict(responses=result.responses, logprobs=result.logprobs,
                                     logits=result.step_logits, stopped=result.stopped_by_eos, topk=topk.calls)
        out[length, chunk] = case
    return out


def _run_cases(hf, kernels):
    """What both CP sizes compute, with the attention kernels' ``kernels`` options."""
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.replay import replay_logits, replay_responses

    model = seeded_model(hf, torch.float32, kernel_options=kernels)
    out = {"cases": {}}
    for length, chunk in CASES:
        prompt, response = random_tokens(hf, length, length), random_tokens(hf, 13, 100 + length)
        with torch.no_grad(), _RecordTopk() as topk:
            state = capture_prompt(model, prompt, chunk)
            logits = replay_logits(model, state, response)[:, 0]
        out["cases"][length, chunk] = dict(
            logits=logits, topk=topk.calls,
            layers={name: {f: t.clone() for f, t in s.tensors().items()} for name, s in state.layers.items()})
    model = seeded_model(hf, torch.float64, kernel_options=kernels)
    length, chunk = GRAD_CASE
    with torch.no_grad():
        state = capture_prompt(model, random_tokens(hf, length, 3), chunk)
    responses = [random_tokens(hf, n, 10 + n)[0] for n in RESPONSES]
    replay_responses(model, state, responses, lambda lp, mask, idx: -(lp * mask).sum() / sum(RESPONSES),
                     micro_batch_size=2)
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out


def _reference(hf, kernels):
    """CP=1: ``_run_cases`` and the rollouts."""
    return {**_run_cases(hf, kernels), "rollouts": _run_rollouts(hf, kernels, SEED)}


def _cp_worker(hf, kernels):
    from megatron.core import parallel_state

    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed
    from megatron_longstraw.longstraw.capture import check_context_parallel_support

    torch.set_num_threads(1)  # two ranks on a small CPU
    init_distributed(ParallelSizes(context=2), seed=1234)
    out = _run_cases(hf, kernels)
    out["cp_rank"] = rank = parallel_state.get_context_parallel_rank()
    # a different generator on CP rank 1: CP rank 0's tokens are broadcast, so rank 1's draws
    # must not matter
    out["rollouts"] = _run_rollouts(hf, kernels, SEED + 1000 * rank)
    out["unsupported"] = value_error_text(lambda: check_context_parallel_support(_NoCPModel()))
    return out


class _NoCPModel(torch.nn.Module):
    """A model with a stateful layer kind that does not declare context-parallel support."""

    def __init__(self):
        from megatron_longstraw.core.binding import StatefulModule

        super().__init__()
        self.layer = type("PlainStateLayer", (torch.nn.Module, StatefulModule), {})()


@pytest.fixture(scope="module")
def runs():
    """CP=1 and CP=2, both with DSA blocks of 5 keys and a few queries per gathered block, so the
    blockwise top-k and the gathered attention cross block and shard boundaries."""
    hf = resolve_hf_config(PRESET)
    small = KernelOptions(dsa_key_block=5, dsa_score_elements=200, dsa_gather_elements=2000)
    return on_one_rank(_reference, hf, small), run_multiprocess(_cp_worker, 2, hf, small)


@pytest.mark.parametrize("case", CASES, ids=[f"P{p}-chunk{c}" for p, c in CASES])
def test_cp2_glm5_topk_logits_and_state_match_cp1(runs, case):
    from megatron_longstraw.core.collectives import shard_plan

    reference, ranks = runs
    ref = reference["cases"][case]
    assert any((t == -1).any() or t.shape[-1] < case[0] for t in ref["topk"])  # DSA drops keys here
    plan = shard_plan(case[0], case[1], 2)
    for rank, run in enumerate(ranks):
        got = run["cases"][case]
        assert len(got["topk"]) == len(ref["topk"])
        for i, (a, b) in enumerate(zip(got["topk"], ref["topk"])):
            assert torch.equal(a, b), f"rank {rank}: top-k call {i} differs"
        diff = (got["logits"] - ref["logits"]).abs().max().item()
        assert diff <= 1e-5, f"rank {rank}: max abs logit diff {diff}"
        own = torch.cat([torch.arange(start + sum(sizes[:rank]), start + sum(sizes[:rank + 1]))
                         for start, sizes in plan])
        for name, layer in ref["layers"].items():
            for field, tensor in layer.items():
                err = (got["layers"][name][field] - tensor[own]).abs().max().item()
                assert err <= 1e-5, (rank, name, field, err)


def test_cp2_glm5_replay_gradients_match_cp1(runs):
    reference, ranks = runs
    for rank, run in enumerate(ranks):
        assert_grads_match(run["grads"], reference["grads"], 1e-5, f"rank {rank}")


@pytest.mark.parametrize("case", ROLLOUT_CASES, ids=[f"P{p}-chunk{c}" for p, c in ROLLOUT_CASES])
@pytest.mark.parametrize("temperature", TEMPERATURES + ("eos",), ids=["greedy", "sampled", "eos"])
def test_cp2_glm5_rollouts_equal_cp1(runs, case, temperature):
    """Decoding from the CP-sharded latents and indexer keys: on both CP ranks the same tokens
    as CP=1, log-probabilities and step logits within 1e-5, and every decode step's DSA top-k
    (global positions) identical to CP=1's; the selections are sparse and take prompt and own
    keys both."""
    reference, ranks = runs
    ref = reference["rollouts"][case][temperature]
    if temperature == "eos":
        assert any(ref["stopped"]) and min(r.numel() for r in ref["responses"]) < NEW
    picks = torch.cat([t.flatten() for t in ref["topk"]])
    assert (picks >= 0).all() and (picks < case[0]).any() and (picks >= case[0]).any()
    steps = len(ref["topk"]) // resolve_hf_config(PRESET)["indexer_types"].count("full")
    last = ref["topk"][-1]  # the last step's queries see the prompt and `steps` own keys: sparse
    assert last.shape[-1] == 8 < case[0] + steps and last.shape[0] >= 2 and len(ref["responses"]) >= 2
    for rank, run in enumerate(ranks):
        got = run["rollouts"][case][temperature]
        assert [r.tolist() for r in got["responses"]] == [r.tolist() for r in ref["responses"]], rank
        assert got["stopped"] == ref["stopped"]
        for a, b in zip(got["logprobs"], ref["logprobs"]):
            diff = (a - b).abs().max().item()
            assert diff <= 1e-5, f"rank {rank}: max abs log-prob diff {diff}"
        for a, b in zip(got["logits"], ref["logits"]):
            diff = (a - b).abs().max().item()
            assert diff <= 1e-5, f"rank {rank}: max abs step-logit diff {diff}"
        assert len(got["topk"]) == len(ref["topk"])
        for i, (a, b) in enumerate(zip(got["topk"], ref["topk"])):
            assert torch.equal(a, b), f"rank {rank}: decode top-k call {i} differs"


def test_cp2_glm5_refusals_name_what_is_missing(runs):
    _, ranks = runs
    for run in ranks:
        assert run["unsupported"] and "PlainStateLayer" in run["unsupported"]

