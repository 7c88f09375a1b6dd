"""``--prompt-gradient exact`` under context parallelism: CP=2 (two gloo processes) capture, exact
replay and the reverse sweep against plain full backprop on one rank (prompt + responses, nothing
detached), fp64, per parameter, on both families (Qwen3.5: full attention + Gated DeltaNet;
GLM-5: MLA + DSA + MoE). The chunk size does not divide the prompt, so the last chunk's shards
are uneven and shorter than the Gated DeltaNet conv tail; the attention kernels run in small
blocks, so the page parts and the DSA top-k and gather cross block boundaries. One spawn runs
every case."""

import pytest
import torch

from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.multiprocess import on_one_rank, run_multiprocess
from megatron_longstraw.testing.parity import (exact_gradients, max_rel_error, random_tokens, seeded_model,
                                              weighted_response_loss)

PRESETS = ("qwen3.5-debug", "glm-5-debug")  # glm-5-debug's index_topk 8 < the prompt: sparse selections
PROMPT, CHUNK = 21, 8  # chunks of 8 | 8 | 5 tokens: shards 4|4, 4|4, 3|2
RESPONSES = (6, 1)     # G = 2 with a 1-token response
SMALL_BLOCKS = KernelOptions(prefix_block=3, dsa_key_block=5, dsa_score_elements=200, dsa_gather_elements=2000)


def _inputs(hf):
    return random_tokens(hf, PROMPT, 3), [random_tokens(hf, n, 10 + n)[0] for n in RESPONSES]


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _full_backprop(hfs):
    """The reference: full backprop through prompt + responses on one rank, per preset."""
    from megatron_longstraw.longstraw.full_graph import full_graph_responses

    out = {}
    for preset, hf in hfs.items():
        model = seeded_model(hf, torch.float64)
        prompt, responses = _inputs(hf)
        full_graph_responses(model, prompt, responses, weighted_response_loss(sum(RESPONSES)), micro_batch_size=1,
                             exact=True)
        out[preset] = _grads(model)
    return out


def _cp_worker(hfs):
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed

    torch.set_num_threads(1)  # two ranks on a small CPU
    init_distributed(ParallelSizes(context=2), seed=1234)
    out = {}
    for preset, hf in hfs.items():
        model = seeded_model(hf, torch.float64, kernel_options=SMALL_BLOCKS)
        prompt, responses = _inputs(hf)
        exact_gradients(model, prompt, responses, weighted_response_loss(sum(RESPONSES)), CHUNK, micro_batch_size=2)
        out[preset] = _grads(model)
    return out


@pytest.fixture(scope="module")
def runs():
    hfs = {preset: resolve_hf_config(preset) for preset in PRESETS}
    return on_one_rank(_full_backprop, hfs), run_multiprocess(_cp_worker, 2, hfs)


@pytest.mark.parametrize("preset", PRESETS)
def test_cp2_exact_gradients_equal_full_backprop(runs, preset):
    """Every CP rank ends with every parameter's full-backprop gradient, to 1e-9 relative (fp64)."""
    reference, ranks = runs
    ref = reference[preset]
    for rank, run in enumerate(ranks):
        got = run[preset]
        for name, want in ref.items():
            if "local_experts" in name and want.abs().max() == 0:  # an expert no token reaching the
                # loss selected: none in the full graph, zeros (or none) after the CP sum
                assert name not in got or got[name].abs().max() == 0, f"rank {rank} {name}: routed under CP only"
                continue
            assert want.abs().max() > 0, f"{name}: zero reference gradient"
            assert name in got, f"rank {rank} {name}: no gradient"
            rel = max_rel_error(got[name], want)
            assert rel <= 1e-9, f"rank {rank} {name}: relative gradient error {rel}"
        assert set(got) <= set(ref), f"rank {rank}: gradients of parameters full backprop leaves alone"


def test_exact_serves_context_with_pipeline_parallelism_and_refuses_expert_with_them(monkeypatch):
    """CP and PP together pass the check; EP together with them gets one error naming the flag
    and the EP size."""
    from megatron.core import parallel_state

    from megatron_longstraw.longstraw.prompt_backward import check_prompt_gradient_support

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: 1)
    check_prompt_gradient_support(torch.nn.Module())
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match=r"^--prompt-gradient exact is not supported with --expert-model-parallel-size "
                                         r"2 > 1 together with tensor, context or pipeline parallelism yet$"):
        check_prompt_gradient_support(torch.nn.Module())
