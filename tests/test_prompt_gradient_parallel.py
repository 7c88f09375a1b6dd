"""``--prompt-gradient exact`` under tensor and expert parallelism (two gloo processes, one spawn,
a process-group setup per layout) against one rank's full backprop through prompt + responses
with nothing detached (fp64), per parameter.

- TP=2: Qwen3.5 without and with sequence parallelism, GLM-5 and Qwen3.5-MoE with it (absorbed
  MLA and Megatron's MoE need it).
  Exact mode (exact capture and replay, then the reverse sweep) and the full graph
  (``full_graph_responses(..., exact=True)``), after Megatron's TP reductions, against this
  rank's shard of one rank's gradients (``parity.tp_grad_errors``).
- EP=2: GLM-5 over two data-parallel ranks, each with a prompt and responses of its own, so the
  ranks' sweeps have 4 and 2 chunks: the second runs idle sweep rounds until the first is done
  (``expert_lockstep``). A rank's dense gradients equal one rank's on its own prompt; a routed
  expert's, on the rank that holds it, the sum of both prompts' (every rank's tokens reach it,
  the idle rounds' included); the routers' expert-bias token counts equal one rank's exact run
  on the same prompt (the idle rounds count none).

Capture chunks of 7 over 23 tokens (7, 7, 7, 2: odd chunks, so sequence parallelism pads the
tokens), G = 2 with a 1-token response, one response per micro-batch.
"""

import pytest
import torch

from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.multiprocess import on_one_rank, run_multiprocess, use_port
from megatron_longstraw.testing.parity import (exact_gradients, max_rel_error, random_tokens, reduce_tp_grads,
                                              seeded_model, weighted_response_loss)

CHUNK = 7
PRESETS = ("qwen3.5-debug", "glm-5-debug", "qwen3.5-moe-debug")
TP_CASES = [("qwen3.5-debug", False), ("qwen3.5-debug", True), ("glm-5-debug", True),
            ("qwen3.5-moe-debug", True)]  # (preset, SP)
MODES = ("exact", "full_graph")
# per EP rank (the TP cases use the first): prompt tokens, response lengths, seed
EP_INPUTS = ((23, (6, 1), 3), (12, (1, 9), 4))
# idle passes per EP rank (True: a sweep round's): 4 and 2 chunks, in capture and in the sweep
EP_IDLE = ((), (False, False, True, True))


def _gradients(preset, mode, inputs=EP_INPUTS[0], sequence_parallel=False):
    """The fp64 model (this rank's shard) and its gradients of ``mode`` on ``inputs``, before any
    TP reduction."""
    from megatron_longstraw.longstraw.full_graph import full_graph_responses

    hf = resolve_hf_config(preset)
    model = seeded_model(hf, torch.float64, parallel_output=True, sequence_parallel=sequence_parallel)
    length, lengths, seed = inputs
    prompt = random_tokens(hf, length, seed)
    responses = [random_tokens(hf, n, 10 * seed + n)[0] for n in lengths]
    loss_fn = weighted_response_loss(sum(lengths))
    if mode == "full_graph":
        full_graph_responses(model, prompt, responses, loss_fn, micro_batch_size=1, exact=True)
    else:
        exact_gradients(model, prompt, responses, loss_fn, CHUNK)
    return model


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _router_counts(model) -> dict:
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("local_tokens_per_expert")}


def _references():
    """One rank: full backprop per preset (the TP cases) and per EP rank's inputs, and the
    routers' token counts of an exact run on each EP rank's inputs."""
    full = {preset: _grads(_gradients(preset, "full_graph")) for preset in PRESETS}
    ep_full = [full["glm-5-debug"]] + [_grads(_gradients("glm-5-debug", "full_graph", inputs))
                                       for inputs in EP_INPUTS[1:]]
    ep_counts = [_router_counts(_gradients("glm-5-debug", "exact", inputs)) for inputs in EP_INPUTS]
    return full, ep_full, ep_counts


def _tp_errors(full) -> dict:
    """TP=2: per case and mode, every parameter's error against its shard of one rank's."""
    from megatron_longstraw.testing.parity import tp_grad_errors

    out = {}
    for preset, sequence_parallel in TP_CASES:
        for mode in MODES:
            model = _gradients(preset, mode, sequence_parallel=sequence_parallel)
            reduce_tp_grads(model)
            grads = _grads(model)
            assert set(grads) == set(full[preset]), f"{preset} {mode}: TP changed which parameters get gradients"
            out[preset, sequence_parallel, mode] = tp_grad_errors(model, grads, full[preset], scale_floor=1e-30)
    return out


def _ep_run(ep_full, ep_counts) -> dict:
    """EP=2: this rank's exact gradients against the expected ones (see the module doc), its
    routers' token counts against one rank's, and the idle sweep rounds it ran."""
    from megatron.core import parallel_state

    from megatron_longstraw.longstraw import expert_lockstep
    from megatron_longstraw.models.builder import expert_global_name

    rank = parallel_state.get_expert_model_parallel_rank()
    idle = []
    run_idle = expert_lockstep.ExpertLockstep.idle_pass
    expert_lockstep.ExpertLockstep.idle_pass = lambda self: (idle.append(self.backward), run_idle(self))
    try:
        model = _gradients("glm-5-debug", "exact", EP_INPUTS[rank])
    finally:
        expert_lockstep.ExpertLockstep.idle_pass = run_idle
    per_rank = model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    grads = {expert_global_name(n, rank * per_rank): g for n, g in _grads(model).items()}
    errors = {}
    for name, grad in grads.items():
        if ".local_experts." in name:
            want = sum(ref[name] if name in ref else torch.zeros_like(grad) for ref in ep_full)
        else:
            want = ep_full[rank][name]
        if want.abs().max() > 0:
            errors[name] = max_rel_error(grad, want)
        else:  # an expert none of whose tokens reaches a loss: exactly 0
            errors[name] = 0.0 if grad.abs().max() == 0 else float("inf")
    own = set(grads) | {expert_global_name(n, rank * per_rank) for n, _ in model.named_parameters()}
    expected_names = {n for n in ep_full[rank] if ".local_experts." not in n} | {
        n for ref in ep_full for n in ref if ".local_experts." in n and n in own}
    counts = _router_counts(model)
    count_diff = max((counts[n] - ep_counts[rank][n]).abs().max().item() for n in counts)
    return dict(errors=errors, missing=expected_names - set(grads), count_diff=count_diff,
                counted=sum(c.sum().item() for c in counts.values()), idle=idle)


def _worker(full, ep_full, ep_counts):
    """TP=2, then EP=2 (a store port each)."""
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)  # two ranks on a small CPU
    out = {}
    for port, (sizes, run) in enumerate(((ParallelSizes(tensor=2), lambda: _tp_errors(full)),
                                         (ParallelSizes(expert=2), lambda: _ep_run(ep_full, ep_counts)))):
        use_port(port)
        init_distributed(sizes, seed=1234)
        try:
            out["tp" if sizes.tensor > 1 else "ep"] = run()
        finally:
            destroy_distributed()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_multiprocess(_worker, 2, *on_one_rank(_references))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset, sequence_parallel", TP_CASES,
                         ids=[f"{p}-{'sp' if sp else 'no-sp'}" for p, sp in TP_CASES])
def test_tp2_gradients_equal_one_rank_full_backprop(runs, preset, sequence_parallel, mode):
    """Every parameter's TP=2 gradient, exact mode and full graph, equals its shard of one rank's
    full backprop to 1e-9 relative (fp64; ~1e-7 while Megatron's cross entropy ran fp64 logits in
    fp32: ``patches.cross_entropy_precision``)."""
    for rank, run in enumerate(runs):
        errors = run["tp"][preset, sequence_parallel, mode]
        name = max(errors, key=errors.get)
        assert errors[name] <= 1e-9, f"rank {rank}: {name}: relative gradient error {errors[name]}"


def test_ep2_exact_gradients_equal_one_rank_full_backprop(runs):
    """EP=2 exact mode with different chunk counts on the two ranks (module doc): every parameter
    to 1e-9 relative (one whose expected gradient is 0: exactly 0)."""
    for rank, run in enumerate(runs):
        ep = run["ep"]
        assert tuple(ep["idle"]) == EP_IDLE[rank], f"rank {rank}: idle passes {ep['idle']}"
        assert not ep["missing"], f"rank {rank}: no gradient for {sorted(ep['missing'])[:3]}"
        name = max(ep["errors"], key=ep["errors"].get)
        assert ep["errors"][name] <= 1e-9, f"rank {rank}: {name}: relative gradient error {ep['errors'][name]}"
        assert ep["counted"] > 0 and ep["count_diff"] == 0, f"rank {rank}: router token counts differ"
