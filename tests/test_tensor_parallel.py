"""TP=2 (two gloo processes) against TP=1: logits and gradients, for every family's debug model."""

import pytest
import torch

from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.multiprocess import run_multiprocess
from megatron_longstraw.testing.parity import logits_and_grads, tp_worker


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_tp2_matches_tp1(single_process, preset, dtype):
    """Logits in fp32 and fp64; gradients (after Megatron's TP reductions) in fp64 only,
    since fp32 itself resolves some tiny random-model gradients to ~1e-3 (see logits_and_grads)."""
    hf = resolve_hf_config(preset)
    tokens = torch.randint(0, hf["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(3))
    logits_tp1, grads_tp1, _ = logits_and_grads(hf, tokens, dtype=dtype)
    results = run_multiprocess(tp_worker, 2, hf, tokens, 2, grads_tp1, dtype)
    for rank, (logits_tp2, worst_grad_rel) in enumerate(results):
        diff = (logits_tp2 - logits_tp1).abs().max().item()
        assert diff <= 1e-5, f"rank {rank}: max abs logit diff {diff}"
        if dtype == torch.float64:
            assert worst_grad_rel <= 1e-5, f"rank {rank}: worst relative grad diff {worst_grad_rel}"
