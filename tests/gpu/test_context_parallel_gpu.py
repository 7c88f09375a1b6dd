"""GPU tier, two GPUs (NCCL, bf16, ``qwen3.5-0.8b``): LongStraw capture/replay with CP=2 against
CP=1 on one GPU — response logits, the Gated DeltaNet state after the prompt and the replay
gradients agree within bf16 tolerance. The tolerance is measured, not assumed: CP changes only
how the same exact math is partitioned and ordered, and so does the prompt chunk size, so CP=2
may differ from CP=1 at most twice as much as CP=1 with half-size chunks differs from CP=1 with
the test's chunks (or a small floor). Half-size chunks have the shapes of CP=2's shards, so the
kernels compiled for one serve the other. Each phase's time goes to stderr (``pytest -s``).
Gradients are compared through per-parameter norms and two seeded random projections (the 0.75B
gradients themselves stay on the GPUs)."""

import sys
import time

import pytest
import torch

from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.testing.multiprocess import on_one_rank, run_multiprocess, with_sizes
from megatron_longstraw.testing.parity import grad_projections

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

PROMPT, CHUNK, RESPONSES = 20_000, 8192, (1024, 777)  # uneven last chunk and shards


def _run(chunks: tuple[int, ...] = (CHUNK,)):
    """Per prompt chunk size: capture, replay logits, replay gradients of ``qwen3.5-0.8b`` in
    bf16 (seed-built weights, broadcast from rank 0 so every CP rank holds the same)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_longstraw.models.builder import build_model
    from megatron_longstraw.models.options import ModelOptions
    from megatron_longstraw.models.presets import resolve_hf_config

    hf = resolve_hf_config("qwen3.5-0.8b")
    model = build_model(hf, ModelOptions(params_dtype=torch.bfloat16))
    if parallel_state.get_context_parallel_world_size() > 1:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    results = {}
    for chunk in chunks:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        results[chunk] = _measure(hf, model, chunk)
        print(f"[cp test] cp={parallel_state.get_context_parallel_world_size()} rank={dist.get_rank()} chunk={chunk}: "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return results


def _measure(hf, model, chunk: int):
    from megatron_longstraw.distributed import device
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.replay import replay_logits, replay_responses

    gen = torch.Generator(device=device()).manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, PROMPT), device=device(), generator=gen)
    responses = [torch.randint(0, hf["vocab_size"], (n,), device=device(), generator=gen) for n in RESPONSES]
    with torch.no_grad():
        state = capture_prompt(model, prompt, chunk)
        logits = replay_logits(model, state, responses[0][None])[:, 0].float().cpu()
    gdn = {name: s.tensors()["recurrent_BHKV"].float().cpu() for name, s in state.layers.items()
           if "recurrent_BHKV" in s.tensors()}
    total = sum(RESPONSES)
    replay_responses(model, state, responses, lambda lp, mask, idx: -(lp * mask).sum() / total, micro_batch_size=1)
    return dict(logits=logits, gdn=gdn, grads=grad_projections(model))


def _errors(run, reference) -> dict:
    """Largest relative differences of two runs: logits (by their scale), Gated DeltaNet states
    (by norm), gradient projections (by the gradient's norm)."""
    errors = {"logits": ((run["logits"] - reference["logits"]).abs().max() / reference["logits"].abs().max()).item(),
              "gdn": max(((run["gdn"][n] - ref).norm() / ref.norm()).item() for n, ref in reference["gdn"].items()),
              "grads": 0.0}
    assert set(run["grads"]) == set(reference["grads"])
    for name, ref in reference["grads"].items():
        error = ((run["grads"][name] - ref).abs().max() / ref[0].clamp_min(1e-12)).item()
        errors["grads"] = max(errors["grads"], error)
    return errors


def test_cp2_matches_cp1_bf16_on_two_gpus(record_property):
    reference = on_one_rank(_run, (CHUNK, CHUNK // 2))
    torch.cuda.empty_cache()
    ranks = run_multiprocess(with_sizes, 2, ParallelSizes(context=2), _run)
    noise = _errors(reference[CHUNK // 2], reference[CHUNK])  # half-size chunks vs the test's chunks
    floors = {"logits": 1e-2, "gdn": 1e-2, "grads": 2e-2}
    figures = [f"chunking {k} {noise[k]:.1e}" for k in floors]
    for rank, run in enumerate(ranks):
        cp2 = _errors(run[CHUNK], reference[CHUNK])
        figures += [f"cp2 rank{rank} {k} {cp2[k]:.1e}" for k in floors]
        record_property("rel_err", ", ".join(figures))
        for key, floor in floors.items():
            assert cp2[key] <= max(2 * noise[key], floor), (rank, key, cp2[key], noise[key])
