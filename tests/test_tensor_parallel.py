"""TP=2 (two gloo processes) against TP=1: logits and gradients, for every family's debug model."""

import pytest
import torch

from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.multiprocess import on_one_rank, run_multiprocess
from megatron_longstraw.testing.parity import logits_and_grads, tp_worker

CASES = [(preset, dtype) for preset in ("qwen3.5-debug", "glm-5-debug") for dtype in (torch.float32, torch.float64)]


def _references(cases):
    tokens = {preset: torch.randint(0, resolve_hf_config(preset)["vocab_size"], (1, 48),
                                    generator=torch.Generator().manual_seed(3)) for preset, _ in cases}
    return [(resolve_hf_config(preset), tokens[preset], *logits_and_grads(resolve_hf_config(preset), tokens[preset],
                                                                          dtype=dtype)[:2], dtype)
            for preset, dtype in cases]


@pytest.fixture(scope="module")
def runs():
    """TP=1 references in this process, then every case at TP=2 in one spawn of two ranks."""
    references = on_one_rank(_references, CASES)
    ranks = run_multiprocess(tp_worker, 2, [(hf, tokens, grads, dtype) for hf, tokens, _, grads, dtype in references],
                             2)
    return references, ranks


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{'fp32' if d == torch.float32 else 'fp64'}-{p}" for p, d in CASES])
def test_tp2_matches_tp1(runs, case):
    """Logits in fp32 and fp64; gradients (after Megatron's TP reductions) in fp64 only,
    since fp32 itself resolves some tiny random-model gradients to ~1e-3 (see logits_and_grads)."""
    references, ranks = runs
    _, _, logits_tp1, _, dtype = references[case]
    for rank, results in enumerate(ranks):
        logits_tp2, worst_grad_rel = results[case]
        diff = (logits_tp2 - logits_tp1).abs().max().item()
        assert diff <= 1e-5, f"rank {rank}: max abs logit diff {diff}"
        if dtype == torch.float64:
            assert worst_grad_rel <= 1e-5, f"rank {rank}: worst relative grad diff {worst_grad_rel}"
