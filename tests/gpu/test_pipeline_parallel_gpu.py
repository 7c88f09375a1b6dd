"""GPU tier, two GPUs (NCCL, bf16): PP=2 through Megatron's pipeline schedule against PP=1 on one
GPU, for both tiny families (GLM-5 with every indexer layer ``full``: the debug preset's shared
layer cannot be split in two) and ``qwen3.5-0.8b`` (tied embeddings: the stages' parts of the
tied weight's gradient are summed as the trainer does) — replay losses and per-parameter
gradients (norms and two seeded projections, as ``test_context_parallel_gpu``) within bf16
tolerance, and each stage's peak memory. The PP=1 run saves its weights; the stages load them
(``load_full_state_dict`` picks each stage's layers). The tiny families also run with two
virtual stages per rank (Megatron's interleaved schedule and its point-to-point exchange over
NCCL). Phases go to stderr (``pytest -s``)."""

import sys
import time

import pytest
import torch

from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.multiprocess import on_one_rank, run_multiprocess, with_sizes
from megatron_longstraw.testing.parity import grad_projections, pipeline_global_names, sum_tied_embedding_grads

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _cases() -> dict:
    """``{name: (hf, prompt length, chunk, response lengths)}``."""
    glm = resolve_hf_config("glm-5-debug")
    glm["indexer_types"] = ["full"] * glm["num_hidden_layers"]
    return {"qwen3.5-debug": (resolve_hf_config("qwen3.5-debug"), 700, 256, (90, 61)),
            "glm-5-debug-full": (glm, 700, 256, (90, 61)),
            "qwen3.5-0.8b": (resolve_hf_config("qwen3.5-0.8b"), 20_000, 8192, (1024, 777))}


def _phase(name: str) -> None:
    """Each rank's progress on stderr (a hang shows where it stopped)."""
    from megatron.core import parallel_state

    print(f"[pp test] pp={parallel_state.get_pipeline_model_parallel_world_size()} "
          f"stage={parallel_state.get_pipeline_model_parallel_rank()} {name} at {time.perf_counter():.1f}",
          file=sys.stderr, flush=True)


def _run(weights_dir: str, save: bool, names=None) -> dict:
    """Per case (``names``: all): capture, replay losses, gradient projections and peak memory;
    the PP=1 run (``save``) writes its weights, the stages read them (each model chunk its layers
    under virtual pipeline stages)."""
    from megatron_longstraw.distributed import device
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.replay import replay_responses
    from megatron_longstraw.models.builder import build_stage_model, load_full_state_dict
    from megatron_longstraw.models.options import ModelOptions

    results = {}
    for name, (hf, prompt_length, chunk, lengths) in _cases().items():
        if names is not None and name not in names:
            continue
        model = build_stage_model(hf, ModelOptions(params_dtype=torch.bfloat16))
        path = f"{weights_dir}/{name}.pt"
        if save:
            torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, path)
        else:
            load_full_state_dict(model, torch.load(path))  # each model chunk its own layers
        gen = torch.Generator(device=device()).manual_seed(0)
        prompt = torch.randint(0, hf["vocab_size"], (1, prompt_length), device=device(), generator=gen)
        responses = [torch.randint(0, hf["vocab_size"], (n,), device=device(), generator=gen) for n in lengths]
        torch.cuda.reset_peak_memory_stats()
        _phase(f"{name} built")
        with torch.no_grad():
            state = capture_prompt(model, prompt, chunk)
        _phase(f"{name} captured")
        total = sum(lengths)
        losses = replay_responses(model, state, responses, lambda lp, mask, idx: -(lp * mask).sum() / total,
                                  micro_batch_size=1)
        _phase(f"{name} replayed")
        sum_tied_embedding_grads(model)
        results[name] = dict(losses=losses, grads=grad_projections(model, pipeline_global_names(model)),
                             peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        state.free()
        del model, state
        torch.cuda.empty_cache()
    return results


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    """Where the PP=1 run saves each case's weights for the pipeline runs."""
    return str(tmp_path_factory.mktemp("pp-weights"))


@pytest.fixture(scope="module")
def runs(weights):
    reference = on_one_rank(_run, weights, True)
    torch.cuda.empty_cache()
    return reference, run_multiprocess(with_sizes, 2, ParallelSizes(pipeline=2), _run, weights, False)


TINY = ("qwen3.5-debug", "glm-5-debug-full")


@pytest.fixture(scope="module")
def virtual_runs(runs, weights):
    """PP=2 with two virtual stages per rank (Megatron's interleaved schedule over NCCL), the
    tiny cases, from the PP=1 run's weights, against its results."""
    reference, _ = runs
    return reference, run_multiprocess(with_sizes, 2, ParallelSizes(pipeline=2, virtual_pipeline=2), _run,
                                       weights, False, TINY)


@pytest.mark.parametrize("name", TINY)
def test_pp2_with_virtual_stages_matches_pp1_bf16_on_two_gpus(virtual_runs, name, record_property):
    _check(virtual_runs, name, record_property)


@pytest.mark.parametrize("name", list(_cases()))
def test_pp2_matches_pp1_bf16_on_two_gpus(runs, name, record_property):
    _check(runs, name, record_property)


def _check(runs, name, record_property):
    """Losses and gradient projections of the stages against PP=1, and the peaks."""
    reference, stages = runs
    ref = reference[name]
    losses = [stage[name]["losses"] for stage in stages if stage[name]["losses"]][0]
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    grads = {key: g for stage in stages for key, g in stage[name]["grads"].items()}
    assert set(grads) == set(ref["grads"])
    grad_error = max(((grads[key] - want).abs().max() / want[0].clamp_min(1e-12)).item()
                     for key, want in ref["grads"].items())
    record_property("rel_err_loss_grads", f"{loss_error:.1e},{grad_error:.1e}")
    record_property("peak_gib_pp1_stage0_stage1", ",".join(
        f"{x:.2f}" for x in [ref["peak_gib"], *(stage[name]["peak_gib"] for stage in stages)]))
    assert loss_error <= 1e-2 and grad_error <= 5e-2, (loss_error, grad_error)
