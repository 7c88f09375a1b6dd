"""GPU tier, two GPUs (NCCL, bf16, ``qwen3.5-0.8b``): LongStraw capture/replay with CP=2 against
CP=1 on one GPU — response logits, the Gated DeltaNet state after the prompt and the replay
gradients agree within bf16 tolerance. Gradients are compared through per-parameter norms and
two seeded random projections (the 0.75B gradients themselves stay on the GPUs)."""

import pytest
import torch

from megatron_longstraw.distributed import ParallelSizes
from megatron_longstraw.testing.multiprocess import on_one_rank, run_multiprocess, with_sizes
from megatron_longstraw.testing.parity import grad_projections

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

PROMPT, CHUNK, RESPONSES = 20_000, 8192, (1024, 777)  # uneven last chunk and shards


def _run():
    """Capture, replay logits, replay gradients of ``qwen3.5-0.8b`` in bf16 (seed-built weights,
    broadcast from rank 0 so every CP rank holds the same)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_longstraw.distributed import device
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.replay import replay_logits, replay_responses
    from megatron_longstraw.models.builder import build_model
    from megatron_longstraw.models.options import ModelOptions
    from megatron_longstraw.models.presets import resolve_hf_config

    hf = resolve_hf_config("qwen3.5-0.8b")
    model = build_model(hf, ModelOptions(params_dtype=torch.bfloat16))
    if parallel_state.get_context_parallel_world_size() > 1:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    gen = torch.Generator(device=device()).manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, PROMPT), device=device(), generator=gen)
    responses = [torch.randint(0, hf["vocab_size"], (n,), device=device(), generator=gen) for n in RESPONSES]
    with torch.no_grad():
        state = capture_prompt(model, prompt, CHUNK)
        logits = replay_logits(model, state, responses[0][None])[:, 0].float().cpu()
    gdn = {name: s.tensors()["recurrent_BHKV"].float().cpu() for name, s in state.layers.items()
           if "recurrent_BHKV" in s.tensors()}
    total = sum(RESPONSES)
    replay_responses(model, state, responses, lambda lp, mask, idx: -(lp * mask).sum() / total, micro_batch_size=1)
    return dict(logits=logits, gdn=gdn, grads=grad_projections(model))


def test_cp2_matches_cp1_bf16_on_two_gpus(record_property):
    reference = on_one_rank(_run)
    torch.cuda.empty_cache()
    ranks = run_multiprocess(with_sizes, 2, ParallelSizes(context=2), _run)
    scale = reference["logits"].abs().max()
    errors = {"logits": 0.0, "gdn": 0.0, "grads": 0.0}
    for run in ranks:
        errors["logits"] = max(errors["logits"], ((run["logits"] - reference["logits"]).abs().max() / scale).item())
        for name, ref in reference["gdn"].items():
            errors["gdn"] = max(errors["gdn"], ((run["gdn"][name] - ref).norm() / ref.norm()).item())
        assert set(run["grads"]) == set(reference["grads"])
        for name, ref in reference["grads"].items():
            # relative to the gradient's norm: the projections are sums over the whole tensor
            error = ((run["grads"][name] - ref).abs().max() / ref[0].clamp_min(1e-12)).item()
            errors["grads"] = max(errors["grads"], error)
    record_property("rel_err_logits_gdn_grads", ",".join(f"{errors[k]:.1e}" for k in ("logits", "gdn", "grads")))
    assert errors["logits"] <= 2e-2 and errors["gdn"] <= 2e-2 and errors["grads"] <= 5e-2, errors
