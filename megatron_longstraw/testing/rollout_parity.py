"""Rollout helpers shared by the CPU tests: a tiny model's rollouts on one rank or per TP rank."""

import torch

from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.distributed import init_distributed
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.models.builder import build_model, load_full_state_dict
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.models.registry import family_for
from megatron_longstraw.rollout.generate import generate_from_state
from megatron_longstraw.testing.hf_reference import build_hf_model


def sharded_output_model(preset: str, dtype=torch.float32, seed: int = 0, sequence_parallel: bool = False):
    """A debug model with the random HF weights of ``seed`` whose logits stay vocabulary-sharded
    under TP (``parallel_output=True``, as in training)."""
    hf = resolve_hf_config(preset)
    model = build_model(hf, ModelOptions(params_dtype=dtype, sequence_parallel=sequence_parallel),
                        parallel_output=True)
    hf_model = build_hf_model(hf, seed=seed).to(dtype)
    load_full_state_dict(model, family_for(hf["model_type"]).weights.hf_to_mcore(hf_model.state_dict(), hf))
    return model.eval()


def rollouts(model, prompt_1S: torch.Tensor, chunk: int, num_samples: int, max_new_tokens: int,
             temperature: float, seed: int) -> tuple[list, list]:
    """Capture ``prompt_1S`` and decode; returns (responses, per-sample step logits)."""
    state = capture_prompt(model, prompt_1S, chunk)
    result = generate_from_state(model, state, num_samples, max_new_tokens, temperature=temperature,
                                 generator=torch.Generator().manual_seed(seed), keep_logits=True)
    return result.responses, result.step_logits


def tp_rollout_worker(models: tuple, tp: int, prompt_1S: torch.Tensor, chunk: int, num_samples: int,
                      max_new_tokens: int, temperatures: tuple, seed: int) -> dict:
    """Run on each rank: for each ``(preset, sequence_parallel)`` of ``models``, TP=``tp``
    rollouts per temperature, ``{(preset, sequence_parallel): {temperature: (responses, logits)}}``."""
    torch.set_num_threads(1)  # tiny matmuls: the ranks share the host's cores
    init_distributed(ParallelSizes(tensor=tp), seed=1234)
    results = {}
    for preset, sequence_parallel in models:
        model = sharded_output_model(preset, sequence_parallel=sequence_parallel)
        results[preset, sequence_parallel] = {t: rollouts(model, prompt_1S, chunk, num_samples, max_new_tokens,
                                                          t, seed) for t in temperatures}
    return results
