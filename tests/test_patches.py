"""The runtime patches: each CPU-compat patch is what makes the Megatron code path run on a CPU;
the others do what their module says (fp64 kept, a checkpoint save that starts no process)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_longstraw import patches
from megatron_longstraw.ops import gated_delta_torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-compat patches apply without a GPU")
ROOT = Path(__file__).resolve().parents[1]


def test_every_patch_module_has_the_interface():
    for name in patches.PATCHES:
        module = patches._module(name)
        assert callable(module.needed) and callable(module.apply) and callable(module.revert)
        assert module.__doc__, name


def test_current_device_patch_is_what_makes_megatron_allocation_work():
    patches.apply_patches()
    patches._module("cpu_current_device").revert()
    try:
        with pytest.raises((RuntimeError, AssertionError)):
            torch.empty(1, device=torch.cuda.current_device())
    finally:
        patches._module("cpu_current_device").apply()
    assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"


def test_rng_tracker_gives_distinct_reproducible_streams_per_tp_rank():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    patches.apply_patches()
    draws = {}
    for tp_rank in (0, 1, 0):
        model_parallel_cuda_manual_seed(7, tp_rank=tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True)
        before = torch.get_rng_state()
        with get_cuda_rng_tracker().fork():
            sample = torch.randn(4)
        assert torch.equal(torch.get_rng_state(), before)  # the caller's stream is untouched
        draws.setdefault(tp_rank, []).append(sample)
    assert torch.equal(draws[0][0], draws[0][1])
    assert not torch.equal(draws[0][0], draws[1][0])


def _naive_gated_delta_rule(q, k, v, g, beta, state=None):
    """Token-by-token recurrence S_t = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T k_t)^T."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    q = gated_delta_torch.l2norm(q.double()) * dk ** -0.5
    k = gated_delta_torch.l2norm(k.double())
    v, g, beta = v.double(), g.double(), beta.double()
    state = torch.zeros(b, h, dk, dv, dtype=torch.float64) if state is None else state.double()
    out = torch.zeros(b, t, h, dv, dtype=torch.float64)
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        kv = torch.einsum("bhk,bhkv->bhv", k[:, i], state)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, i], (v[:, i] - kv) * beta[:, i, :, None])
        out[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i], state)
    return out, state


def test_torch_gated_delta_rule_matches_naive_recurrence_and_chains_state():
    gen = torch.Generator().manual_seed(0)
    b, t, h, dk, dv = 2, 150, 3, 8, 12
    q, k = torch.randn(b, t, h, dk, generator=gen), torch.randn(b, t, h, dk, generator=gen)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen)
    beta = torch.rand(b, t, h, generator=gen)
    expected, expected_state = _naive_gated_delta_rule(q, k, v, g, beta)
    out, state = gated_delta_torch.chunk_gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert (out.double() - expected).abs().max() < 1e-5
    assert (state.double() - expected_state).abs().max() < 1e-5
    # two halves chained through the state equal one pass
    cut = 77
    first, mid = gated_delta_torch.chunk_gated_delta_rule(
        q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    second, _ = gated_delta_torch.chunk_gated_delta_rule(
        q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], initial_state=mid,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert (torch.cat([first, second], 1).double() - expected).abs().max() < 1e-5


def test_torch_causal_conv1d_matches_padded_conv_and_chains_state():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 19, 6, generator=gen)
    weight = torch.randn(6, 4, generator=gen)
    padded = torch.nn.functional.pad(x.transpose(1, 2), (3, 0))
    expected = torch.nn.functional.silu(
        torch.nn.functional.conv1d(padded, weight.unsqueeze(1), groups=6)).transpose(1, 2)
    out, _ = gated_delta_torch.causal_conv1d(x, weight, activation="silu")
    assert torch.allclose(out, expected, atol=1e-6)
    first, state = gated_delta_torch.causal_conv1d(x[:, :5], weight, activation="silu",
                                                   output_final_state=True)
    second, _ = gated_delta_torch.causal_conv1d(x[:, 5:], weight, activation="silu",
                                                initial_state=state)
    assert torch.allclose(torch.cat([first, second], 1), expected, atol=1e-6)


def test_tensor_cuda_patch_keeps_tensors_on_cpu():
    patches.apply_patches()
    patches._module("cpu_tensor_cuda").revert()
    try:
        with pytest.raises((RuntimeError, AssertionError)):
            torch.ones(1).cuda()
    finally:
        patches._module("cpu_tensor_cuda").apply()
    t = torch.ones(1)
    assert t.cuda() is t


def _megatron_adam_step(model, clip_grad):
    from megatron_longstraw.config.parallel import ParallelConfig
    from megatron_longstraw.config.training import OptimizerConfig
    from megatron_longstraw.training.optimizer import build_optimizer, build_scheduler, wrap_ddp

    adam = OptimizerConfig(lr=1e-2, min_lr=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                           clip_grad=clip_grad, lr_warmup_iters=0, lr_decay_iters=10, lr_decay_style="constant")
    (ddp,) = chunks = wrap_ddp(model, ParallelConfig())
    optimizer = build_optimizer(chunks, adam, ParallelConfig(), bf16=False)
    build_scheduler(optimizer, adam, train_iters=10)  # sets each group's lr and weight decay (none on norms/biases)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    return ddp, optimizer


def test_megatron_optimizer_on_cpu_equals_torch_adamw_with_clipping(single_process):
    """With ``cpu_optimizer_device`` Megatron's DDP + Adam + grad clipping + scheduler run on the
    CPU and make exactly torch's AdamW step on clipped gradients (no weight decay on 1-D
    parameters and biases, Megatron's rule); without the patch they cannot allocate."""
    from megatron_longstraw.models.presets import resolve_hf_config
    from megatron_longstraw.testing.hf_reference import build_hf_model
    from megatron_longstraw.testing.parity import forward_logits, megatron_from_hf

    hf = resolve_hf_config("qwen3.5-debug")
    model = megatron_from_hf(hf, build_hf_model(hf, seed=0))
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, hf["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    ddp, optimizer = _megatron_adam_step(model, clip_grad=0.05)
    forward_logits(ddp.module, tokens).pow(2).mean().backward()
    ddp.finish_grad_sync()
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    ok, grad_norm, _ = optimizer.step()
    expected_norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
    assert ok and abs(grad_norm - expected_norm) <= 1e-5 * expected_norm
    assert expected_norm > 0.05  # clipping is active
    params = {n: reference[n].clone().requires_grad_() for n in reference}
    for n, p in params.items():
        p.grad = grads[n] * (0.05 / (expected_norm + 1e-6))
    no_decay = [p for n, p in params.items() if p.dim() == 1 or n.endswith(".bias")]
    decay = [p for n, p in params.items() if not (p.dim() == 1 or n.endswith(".bias"))]
    torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                      lr=1e-2, betas=(0.9, 0.95), eps=1e-8).step()
    for n, p in model.named_parameters():
        assert torch.allclose(p.detach(), params[n].detach(), rtol=1e-6, atol=1e-7), n

    patches._module("cpu_optimizer_device").revert()
    try:
        with pytest.raises((RuntimeError, AssertionError)):
            _megatron_adam_step(model, clip_grad=1.0)
    finally:
        patches._module("cpu_optimizer_device").apply()


def test_no_compile_patch_on_cpu_or_when_asked(monkeypatch):
    """Dynamo is off on CPU, and on a GPU only when ``LONGSTRAW_NO_COMPILE=1`` (the GPU test
    tier); apply/revert switch torch's own setting."""
    import torch._dynamo

    from megatron_longstraw.patches import no_compile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LONGSTRAW_NO_COMPILE", raising=False)
    assert not no_compile.needed()
    monkeypatch.setenv("LONGSTRAW_NO_COMPILE", "1")
    assert no_compile.needed()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LONGSTRAW_NO_COMPILE")
    assert no_compile.needed()
    before = torch._dynamo.config.disable
    no_compile.apply()
    assert torch._dynamo.config.disable is True
    no_compile.revert()
    assert torch._dynamo.config.disable == no_compile._ORIGINAL
    torch._dynamo.config.disable = before


def test_attention_output_gate_keeps_fp64_and_is_unchanged_below():
    """fp64 gates in fp64 (Megatron's rounds to fp32); below fp64 Megatron's own function runs."""
    from megatron.core.transformer.attention import Attention

    patches.apply_patches()
    generator = torch.Generator().manual_seed(3)
    x, gate = torch.randn(4, 2, 6, generator=generator), torch.randn(4, 2, 6, generator=generator)
    out = Attention._apply_output_gate(None, x.double(), gate.double())
    assert out.dtype == torch.float64
    assert (out - x.double() * torch.sigmoid(gate.double())).abs().max() <= 1e-15
    patches._module("attention_gate_precision").revert()
    try:
        original = Attention._apply_output_gate(None, x.double(), gate.double())
        below = Attention._apply_output_gate(None, x.bfloat16(), gate.bfloat16())
    finally:
        patches._module("attention_gate_precision").apply()
    assert (original - out).abs().max() > 1e-12  # Megatron's rounds the gate to fp32
    assert torch.equal(Attention._apply_output_gate(None, x.bfloat16(), gate.bfloat16()), below)


def test_moe_router_probabilities_keep_fp64_and_are_unchanged_below():
    """fp64 sigmoid-routing probabilities in fp64 with Megatron's selection (Megatron's round the
    scores to fp32); the dense output too; below fp64 Megatron's own function runs."""
    from megatron.core.transformer.moe import router

    patches.apply_patches()
    generator = torch.Generator().manual_seed(5)
    logits, bias = torch.randn(6, 8, generator=generator), torch.randn(8, generator=generator) * 0.1
    options = dict(topk=3, num_groups=4, group_topk=2, scaling_factor=2.5, score_function="sigmoid")
    probs, routing_map = router.topk_routing_with_score_function(logits.double(), expert_bias=bias, **options)
    dense, top = router.topk_routing_with_score_function(logits.double(), expert_bias=bias, dense_output=True,
                                                         **options)
    chosen = torch.where(routing_map, torch.sigmoid(logits.double()), 0.0)
    expected = 2.5 * chosen / chosen.sum(-1, keepdim=True)
    assert probs.dtype == torch.float64 and (probs - expected).abs().max() <= 1e-15
    assert (dense - expected.gather(1, top)).abs().max() <= 1e-15
    patches._module("moe_router_precision").revert()
    try:
        original, original_map = router.topk_routing_with_score_function(logits.double(), expert_bias=bias,
                                                                         **options)
        below = router.topk_routing_with_score_function(logits, expert_bias=bias, **options)
    finally:
        patches._module("moe_router_precision").apply()
    assert torch.equal(original_map, routing_map)
    assert (original - probs).abs().max() > 1e-12  # Megatron's scores went through fp32
    again = router.topk_routing_with_score_function(logits, expert_bias=bias, **options)
    assert all(torch.equal(a, b) for a, b in zip(again, below))


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_moe_softmax_router_probabilities_keep_fp64(pre_softmax):
    """fp64 softmax routing (Qwen3.5-MoE's): the selected experts' probabilities in fp64, Megatron's
    selection; Megatron's own went through fp32."""
    from megatron.core.transformer.moe import router

    patches.apply_patches()
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    options = dict(topk=3, score_function="softmax", use_pre_softmax=pre_softmax)
    probs, routing_map = router.topk_routing_with_score_function(logits, **options)
    dense, top = router.topk_routing_with_score_function(logits, dense_output=True, **options)
    full = torch.softmax(logits, -1)
    chosen = torch.where(routing_map, full, 0.0)
    expected = chosen if pre_softmax else chosen / chosen.sum(-1, keepdim=True)
    assert probs.dtype == torch.float64 and (probs - expected).abs().max() <= 1e-15
    assert (dense - expected.gather(1, top)).abs().max() <= 1e-15
    patches._module("moe_router_precision").revert()
    try:
        original, original_map = router.topk_routing_with_score_function(logits, **options)
    finally:
        patches._module("moe_router_precision").apply()
    assert torch.equal(original_map, routing_map) and (original - probs).abs().max() > 1e-12


def test_vocab_parallel_cross_entropy_keeps_fp64_and_is_unchanged_below(single_process):
    """fp64 logits' cross entropy and its gradient in fp64 (Megatron's went through fp32); below
    fp64 Megatron's own computation runs."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    patches.apply_patches()
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 2, 11, generator=generator) * 4
    target = torch.randint(0, 11, (5, 2), generator=generator)

    def loss_and_grad(logits):
        logits = logits.clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(logits.clone(), target)
        loss.sum().backward()
        return loss.detach(), logits.grad

    loss, grad = loss_and_grad(logits.double())
    want = logits.double().requires_grad_(True)
    want_loss = torch.nn.functional.cross_entropy(want.flatten(0, 1), target.flatten(), reduction="none")
    want_loss.sum().backward()
    assert loss.dtype == torch.float64 and (loss.flatten() - want_loss.detach()).abs().max() <= 1e-14
    assert (grad - want.grad).abs().max() <= 1e-15
    below = loss_and_grad(logits)
    patches._module("cross_entropy_precision").revert()
    try:
        original = loss_and_grad(logits.double())
        original_below = loss_and_grad(logits)
    finally:
        patches._module("cross_entropy_precision").apply()
    assert original[0].dtype == torch.float32 and (original[1] - grad).abs().max() > 1e-12  # through fp32
    assert all(torch.equal(a, b) for a, b in zip(below, original_below))


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                state_and_rest = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if state_and_rest[0] != "Z":
                parents[int(entry)] = int(state_and_rest[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return f"{pid} (gone)"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_a_trainer_killed_mid_save_leaves_no_process_behind(tmp_path):
    """SIGKILL while a checkpoint is being saved: nothing the trainer started lives on (without
    ``save_results_in_process``, Megatron's file writer leaves its results-queue server and resource
    tracker running, orphaned). The tracker file's temporary is a FIFO here, so the save stops there
    until killed."""
    save = tmp_path / "ckpt"
    save.mkdir()
    os.mkfifo(save / "latest_checkpointed_iteration.txt.tmp")
    argv = ["--train-iters", "1", "--global-batch-size", "1", "--num-generations", "2",
            "--synthetic-prompt-length", "32", "--prompt-chunk-size", "32", "--max-response-length", "1",
            "--replay-micro-batch-size", "2", "--save", str(save), "--wandb-save-dir", str(tmp_path / "run"),
            "--wandb-mode", "disabled"]
    log = tmp_path / "trainer.log"
    with open(log, "wb") as out:
        trainer = subprocess.Popen([sys.executable, str(ROOT / "train_grpo.py"), *argv], cwd=tmp_path,
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while trainer.poll() is None and not (save / "iter_0000001").is_dir() and time.monotonic() < deadline:
            time.sleep(0.02)  # then the checkpoint is in place and the tracker write blocks on the FIFO
        assert trainer.poll() is None and (save / "iter_0000001").is_dir(), log.read_text()[-2000:]
        tree = _descendants(trainer.pid)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {pid: _command(pid) for pid in tree if _alive(pid)}
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, left
    assert not (save / "latest_checkpointed_iteration.txt").exists()  # killed mid-save
