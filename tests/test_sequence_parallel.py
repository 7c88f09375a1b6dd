"""TP=2 with Megatron's sequence parallelism (two gloo processes) against TP=1 for LongStraw
capture/replay and the full-graph baseline, for every family's debug model: response logits
and the last prompt logits (fp32), per-parameter gradients of replay and of the baseline after
Megatron's TP reductions (fp64, see ``parity.logits_and_grads`` for why). Odd prompts, chunks and responses included: under sequence
parallelism the model steps pad a slice to a multiple of TP and the stateful layers ignore the
padding. One spawn runs every case."""

import pytest
import torch

from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.multiprocess import on_one_rank, run_multiprocess

PRESETS = ("qwen3.5-debug", "glm-5-debug")
# (prompt length, chunk size): uneven last chunk (16, 16, 13), odd chunks (7 ...), one chunk
CASES = [(45, 16), (21, 7), (10, 64)]
RESPONSE = 13
GRAD_CASE = (21, 8)
RESPONSES = (9, 4, 6)


def _tokens(hf, n, seed):
    return torch.randint(0, hf["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _model(hf, dtype, parallel_output=False):
    """``parallel_output``: this rank's vocabulary shard of the logits, as the trainer's model
    (the loss, Megatron's vocab-parallel cross entropy, needs it under TP); else full logits."""
    from megatron.core import parallel_state

    from megatron_longstraw.models.builder import build_model, load_full_state_dict
    from megatron_longstraw.models.options import ModelOptions
    from megatron_longstraw.models.registry import family_for
    from megatron_longstraw.testing.hf_reference import build_hf_model

    tp = parallel_state.get_tensor_model_parallel_world_size()
    options = ModelOptions(params_dtype=dtype, sequence_parallel=tp > 1)
    model = build_model(hf, options, parallel_output=parallel_output)
    hf_model = build_hf_model(hf, seed=0).to(dtype)
    load_full_state_dict(model, family_for(hf["model_type"]).weights.hf_to_mcore(hf_model.state_dict(), hf))
    return model.eval()


def _nll(total_tokens):
    def loss_fn(logprobs_RB, mask_RB, indices):
        return -(logprobs_RB * mask_RB).sum() / total_tokens
    return loss_fn


def _run_cases(hf):
    """Per case the replay logits and the last prompt logits (full vocabulary); then the model
    and its fp64 replay gradients after Megatron's TP reductions."""
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.full_graph import full_graph_logits, full_graph_responses
    from megatron_longstraw.longstraw.replay import replay_logits, replay_responses
    from megatron_longstraw.testing.parity import reduce_tp_grads

    model = _model(hf, torch.float32)
    out = {"cases": {}}
    for length, chunk in CASES:
        prompt, response = _tokens(hf, length, length), _tokens(hf, RESPONSE, 100 + length)
        with torch.no_grad():
            state = capture_prompt(model, prompt, chunk)
            logits = replay_logits(model, state, response)[:, 0]
            last = state.last_logits_BV[0]  # full vocabulary (parallel_output=False)
            full = full_graph_logits(model, prompt, response)[:, 0]
        out["cases"][length, chunk] = dict(logits=logits.clone(), last_logits=last.clone(), full=full)
    model = _model(hf, torch.float64, parallel_output=True)
    length, chunk = GRAD_CASE
    prompt = _tokens(hf, length, 3)
    responses = [_tokens(hf, n, 10 + n)[0] for n in RESPONSES]
    full_graph_responses(model, prompt, responses, _nll(sum(RESPONSES)), micro_batch_size=2)
    reduce_tp_grads(model)
    out["full_grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        state = capture_prompt(model, prompt, chunk)
    replay_responses(model, state, responses, _nll(sum(RESPONSES)), micro_batch_size=2)
    reduce_tp_grads(model)
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, model


def _tp_worker(hfs, references):
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed
    from megatron_longstraw.testing.parity import tp_grad_errors

    torch.set_num_threads(1)  # two ranks on a small CPU
    init_distributed(ParallelSizes(tensor=2), seed=1234)
    results = {}
    for preset, hf in hfs.items():
        out, model = _run_cases(hf)
        results[preset] = dict(cases=out["cases"])
        for key in ("grads", "full_grads"):
            reference = references[preset][key]
            assert set(out[key]) == set(reference), "sequence parallelism changed which parameters get gradients"
            results[preset]["worst_" + key] = tp_grad_errors(model, out[key], reference, scale_floor=1e-30)
    return results


@pytest.fixture(scope="module")
def runs():
    hfs = {preset: resolve_hf_config(preset) for preset in PRESETS}
    references = on_one_rank(lambda: {preset: _run_cases(hf)[0] for preset, hf in hfs.items()})
    return references, run_multiprocess(_tp_worker, 2, hfs, references)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("case", CASES, ids=[f"P{p}-chunk{c}" for p, c in CASES])
def test_sp_capture_replay_logits_match_tp1(runs, preset, case):
    references, ranks = runs
    ref = references[preset]["cases"][case]
    for rank, run in enumerate(ranks):
        got = run[preset]["cases"][case]
        diff = (got["logits"] - ref["logits"]).abs().max().item()
        assert diff <= 1e-5, f"rank {rank}: max abs logit diff {diff}"
        diff = (got["last_logits"] - ref["last_logits"]).abs().max().item()
        assert diff <= 1e-5, f"rank {rank}: max abs last-prompt logit diff {diff}"
        diff = (got["full"] - ref["full"]).abs().max().item()
        assert diff <= 1e-5, f"rank {rank}: full-graph baseline: max abs logit diff {diff}"


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("path", ["grads", "full_grads"], ids=["replay", "full_graph"])
def test_sp_gradients_match_tp1(runs, preset, path):
    """LongStraw replay and the full-graph baseline (``--replay-mode full``)."""
    _, ranks = runs
    for rank, run in enumerate(ranks):
        worst = run[preset]["worst_" + path]
        name = max(worst, key=worst.get)
        assert worst[name] <= 1e-5, f"rank {rank}: {name}: relative gradient error {worst[name]}"
