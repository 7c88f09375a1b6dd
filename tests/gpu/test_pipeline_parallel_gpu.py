"""GPU tier, two GPUs (NCCL, bf16, ``qwen3.5-0.8b`` with the HF reference's random weights): PP=2
through Megatron's pipeline schedule against PP=1 on one GPU — replay losses and per-parameter
gradients (norms and two seeded projections, as ``test_context_parallel_gpu``) within bf16
tolerance, and each stage's peak memory."""

import sys
import time

import pytest
import torch

from megatron_longstraw.distributed import ParallelSizes
from megatron_longstraw.testing.multiprocess import on_one_rank, run_multiprocess, with_sizes
from megatron_longstraw.testing.parity import grad_projections, pipeline_global_names

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

PROMPT, CHUNK, RESPONSES = 20_000, 8192, (1024, 777)


def _phase(name: str) -> None:
    """Each rank's progress on stderr (``pytest -s``; a hang shows where it stopped)."""
    from megatron.core import parallel_state

    print(f"[pp test] pp={parallel_state.get_pipeline_model_parallel_world_size()} "
          f"stage={parallel_state.get_pipeline_model_parallel_rank()} {name} at {time.perf_counter():.1f}",
          file=sys.stderr, flush=True)


def _run():
    from megatron_longstraw.distributed import device
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.replay import replay_responses
    from megatron_longstraw.models.options import ModelOptions
    from megatron_longstraw.models.presets import resolve_hf_config
    from megatron_longstraw.testing.hf_reference import build_hf_model
    from megatron_longstraw.testing.parity import megatron_from_hf

    hf = resolve_hf_config("qwen3.5-0.8b")
    model = megatron_from_hf(hf, build_hf_model(hf, seed=0).to(torch.bfloat16),
                             ModelOptions(params_dtype=torch.bfloat16))
    gen = torch.Generator(device=device()).manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, PROMPT), device=device(), generator=gen)
    responses = [torch.randint(0, hf["vocab_size"], (n,), device=device(), generator=gen) for n in RESPONSES]
    torch.cuda.reset_peak_memory_stats()
    _phase("built")
    with torch.no_grad():
        state = capture_prompt(model, prompt, CHUNK)
    _phase("captured")
    total = sum(RESPONSES)
    losses = replay_responses(model, state, responses, lambda lp, mask, idx: -(lp * mask).sum() / total,
                              micro_batch_size=1)
    _phase("replayed")
    grads = grad_projections(model, pipeline_global_names(model))
    return dict(losses=losses, grads=grads, peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def test_pp2_matches_pp1_bf16_on_two_gpus(record_property):
    reference = on_one_rank(_run)
    torch.cuda.empty_cache()
    stages = run_multiprocess(with_sizes, 2, ParallelSizes(pipeline=2), _run)
    losses = [stage["losses"] for stage in stages if stage["losses"]][0]
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"]))
    grads = {name: g for stage in stages for name, g in stage["grads"].items()}
    assert set(grads) == set(reference["grads"])
    grad_error = max(((grads[n] - ref).abs().max() / ref[0].clamp_min(1e-12)).item()
                     for n, ref in reference["grads"].items())
    record_property("rel_err_loss_grads", f"{loss_error:.1e},{grad_error:.1e}")
    record_property("peak_gib_pp1_stage0_stage1", ",".join(f"{x:.2f}" for x in
                                                          [reference["peak_gib"], *(s["peak_gib"] for s in stages)]))
    assert loss_error <= 1e-2 and grad_error <= 5e-2, (loss_error, grad_error)
