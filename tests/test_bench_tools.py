"""Benchmark plumbing: FLOPs formula, saved-activation meter, and the bench tool end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_longstraw.longstraw.activation_meter import SavedTensorMeter
from megatron_longstraw.longstraw.cost_model import memory_floor_bytes
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.models.qwen3_5.profile import capture_flops as qwen_prompt_flops
from megatron_longstraw.testing.multiprocess import run_script

ROOT = Path(__file__).resolve().parents[1]


def test_qwen_prompt_flops_terms():
    hf = resolve_hf_config("qwen3.5-0.8b")
    linear = 10**9
    f1, f2 = qwen_prompt_flops(hf, linear, 1000), qwen_prompt_flops(hf, linear, 2000)
    attention_1k = 6 * 2 * 8 * 512 * 1000 ** 2 / 2
    last_logits = 2 * hf["hidden_size"] * hf["vocab_size"]  # independent of the prompt length
    # doubling the prompt doubles the linear and GDN terms and quadruples attention
    assert abs((f2 - 2 * f1) - (2 * attention_1k - last_logits)) / f2 < 1e-9
    assert f1 > 2 * linear * 1000


def test_saved_tensor_meter_counts_saved_storage_once_and_skips_excluded():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with SavedTensorMeter(exclude=[w]) as meter:
        y = (x @ w).sin()  # matmul saves x (and w, excluded); sin saves x @ w
        (y * y).sum()      # saves y twice -> counted once
    assert meter.nbytes == 3 * x.numel() * 4
    assert memory_floor_bytes(10, 2, 4, 100, 50) == 10 * 8 + 150


def test_saved_tensor_meter_leaves_no_reference_cycle():
    """An op that saves its own output (``exp``) under the meter, in a graph that no backward
    runs through (as the parts of a recomputed chunk beyond what its injected gradients reach):
    dropping the output frees it without the garbage collector. A pack hook that returns the
    tensor itself ties the output to its own graph node, a cycle through autograd that even
    the collector cannot break: the graph and all it saved would outlive the step."""
    import gc
    import weakref

    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorMeter() as meter:
        y = x.exp()
    assert meter.nbytes == x.numel() * 4
    alive = weakref.ref(y)
    del y
    gc.collect()
    assert alive() is None


def test_bench_tool_end_to_end(tmp_path):
    cmd = [ROOT / "tools/bench_longstraw.py", "--model", "qwen3.5-debug",
           "--prompt-lengths", "96", "--group-sizes", "1,3", "--response-length", "16",
           "--prompt-chunk-size", "32", "--warmup-prompt-length", "40", "--output-dir", str(tmp_path)]
    run_script(cmd[0], cmd[1:], check=True)
    data = json.loads((tmp_path / "bench_qwen3.5-debug.json").read_text())
    assert "tools/bench_longstraw.py" in data["command"]
    modes = sorted((r["mode"], r["group"]) for r in data["results"])
    assert modes == [("full", 1), ("longstraw", 1), ("longstraw", 3)]
    assert (tmp_path / "bench_qwen3.5-debug.png").stat().st_size > 1000
    assert "Command: `" in (tmp_path / "bench_qwen3.5-debug.md").read_text()


def test_bench_tool_times_the_exact_prompt_backward(tmp_path):
    """``--prompt-gradient exact``: the reverse sweep's time and peak and the state-gradient bytes
    per point, in the JSON and the table."""
    cmd = [ROOT / "tools/bench_longstraw.py", "--model", "qwen3.5-debug",
           "--prompt-lengths", "64", "--group-sizes", "2", "--response-length", "8", "--modes", "longstraw",
           "--prompt-chunk-size", "32", "--warmup-prompt-length", "0", "--prompt-gradient", "exact",
           "--output-dir", str(tmp_path)]
    run_script(cmd[0], cmd[1:], check=True)
    (result,) = json.loads((tmp_path / "bench_qwen3.5-debug.json").read_text())["results"]
    assert result["prompt_gradient"] == "exact" and result["prompt_backward_s"] > 0
    assert 0 < result["state_grad_gib"] < result["floor_gib"]
    # the floor counts one chunk's recompute when it is larger than one micro-batch's replay
    assert result["sweep_activation_gib"] > 0 and result["floor_activation_gib"] == pytest.approx(
        max(result["activation_gib"], result["sweep_activation_gib"]))
    assert result["prompt_backward_mfu"] > 0
    table = (tmp_path / "bench_qwen3.5-debug.md").read_text()
    assert "Prompt gradient: exact." in table and "| prompt | G | sweep s | sweep / capture |" in table


def test_bench_tool_glm_reports_flops_and_capture_split(tmp_path):
    """GLM-5 tiny through the benchmark: capture MFU from the GLM FLOPs formula and the capture
    time split into indexer, sparse MLA, MoE and the rest (which add up to the capture time)."""
    cmd = [ROOT / "tools/bench_longstraw.py", "--model", "glm-5-debug", "--num-layers", "3",
           "--prompt-lengths", "80", "--group-sizes", "2", "--response-length", "8", "--modes", "longstraw",
           "--prompt-chunk-size", "32", "--warmup-prompt-length", "0", "--output-dir", str(tmp_path)]
    run_script(cmd[0], cmd[1:], check=True)
    (result,) = json.loads((tmp_path / "bench_glm-5-debug.json").read_text())["results"]
    split = result["capture_split_s"]
    assert sorted(split) == ["indexer", "moe", "rest", "sparse_attention"]
    assert all(split[k] > 0 for k in ("indexer", "moe", "sparse_attention"))
    assert abs(sum(split.values()) - result["capture_s"]) < 1e-9
    assert result["capture_tflops"] > 0
    assert "| indexer top-k |" in (tmp_path / "bench_glm-5-debug.md").read_text()


def test_num_layers_keeps_the_first_layers_of_every_pattern():
    """``--num-layers``: the same widths at a reduced depth (qwen3.6-27b's 3:1 Gated DeltaNet /
    attention pattern, GLM-5's dense-then-MoE and indexer patterns cut alike); out of range is a
    clear error."""
    from megatron_longstraw.models.presets import resolve_hf_config, with_num_layers

    qwen = with_num_layers(resolve_hf_config("qwen3.6-27b"), 8)
    assert qwen["num_hidden_layers"] == 8 and qwen["hidden_size"] == 5120
    assert qwen["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + \
        ["full_attention"]
    glm = with_num_layers(resolve_hf_config("glm-5-debug"), 3)
    assert (glm["mlp_layer_types"], glm["indexer_types"], glm["first_k_dense_replace"]) == \
        (["dense", "sparse", "sparse"], ["full", "full", "shared"], 1)
    assert with_num_layers(resolve_hf_config("glm-5-debug"), 1)["mlp_layer_types"] == ["dense"]
    for bad in (0, 5):
        with pytest.raises(ValueError, match=rf"--num-layers must be in \[1, 4\] for this model, got {bad}"):
            with_num_layers(resolve_hf_config("glm-5-debug"), bad)


def test_glm_prompt_flops_terms():
    """Indexer scores grow with the square of the prompt; sparse MLA linearly once the prompt
    passes index_topk; routed experts count as num_experts_per_tok experts per token."""
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import destroy_distributed, init_distributed
    from megatron_longstraw.models.flops import active_linear_weight_elements
    from megatron_longstraw.models.glm5.profile import capture_flops as glm_prompt_flops
    from megatron_longstraw.testing.parity import seeded_model

    hf = resolve_hf_config("glm-5-debug")
    init_distributed(ParallelSizes(), seed=1)
    try:
        model = seeded_model(hf)
        every = sum(p.numel() for n, p in model.named_parameters() if n.startswith("decoder.") and p.dim() == 2)
        # expert 0 of every MoE layer: each layer's routed experts count as num_experts_per_tok of them
        expert_0 = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts.local_experts.0." in n)
        active = active_linear_weight_elements(model, hf["num_experts_per_tok"])
        assert expert_0 > 0
        assert active == every - expert_0 * (hf["n_routed_experts"] - hf["num_experts_per_tok"])
    finally:
        destroy_distributed()
    heads, d, full = hf["index_n_heads"], hf["index_head_dim"], hf["indexer_types"].count("full")
    f = lambda p: glm_prompt_flops(hf, 0, p) - 2 * hf["hidden_size"] * hf["vocab_size"]  # noqa: E731
    mla = hf["num_hidden_layers"] * hf["num_attention_heads"] * 2 * (2 * hf["kv_lora_rank"] + hf["qk_rope_head_dim"])
    k = hf["index_topk"]
    assert f(1) == full * 2 * heads * d + mla
    assert f(100) == full * 2 * heads * d * 100 * 101 / 2 + mla * (k * 100 - k * (k - 1) / 2)


def test_bench_tool_under_context_and_pipeline_parallelism(tmp_path):
    """Two gloo ranks (torchrun): the benchmark runs LongStraw with the prompt sharded (CP column
    2, per-rank state of half the pages), and refuses the full-graph mode under CP; with two
    pipeline stages it replays through the schedule and reports each stage's floor (its own
    layers: each below the one-stage floor)."""
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            str(ROOT / "tools/bench_longstraw.py"), "--model", "qwen3.5-debug", "--context-parallel-size", "2",
            "--response-length", "8", "--prompt-chunk-size", "32", "--warmup-prompt-length", "0",
            "--output-dir", str(tmp_path)]
    subprocess.run(base + ["--prompt-lengths", "128", "--group-sizes", "2", "--modes", "longstraw"],
                   check=True, capture_output=True, timeout=300)
    (result,) = json.loads((tmp_path / "bench_qwen3.5-debug.json").read_text())["results"]
    assert result["context_parallel"] == 2 and len(result["replay_s"]) == 2
    single = run_script(ROOT / "tools/bench_longstraw.py", ["--model", "qwen3.5-debug",
                        "--prompt-lengths", "128", "--group-sizes", "2", "--response-length", "8",
                        "--modes", "longstraw", "--prompt-chunk-size", "32", "--warmup-prompt-length", "0",
                        "--output-dir", str(tmp_path / "cp1")], check=True)
    assert single.returncode == 0
    (cp1,) = json.loads((tmp_path / "cp1" / "bench_qwen3.5-debug.json").read_text())["results"]
    # the attention pages halve; the replicated Gated DeltaNet state does not
    assert cp1["state_gib"] / 2 < result["state_gib"] < cp1["state_gib"]
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_longstraw import parse_args

    for flag in ("--context-parallel-size", "--pipeline-model-parallel-size"):
        with pytest.raises(ValueError, match=f"{flag} 2: the full-graph mode"):
            parse_args([flag, "2", "--modes", "longstraw,full"])
    pipeline = [arg if arg != "--context-parallel-size" else "--pipeline-model-parallel-size" for arg in base]
    subprocess.run([*pipeline[:-1], str(tmp_path / "pp2"), "--prompt-lengths", "128", "--group-sizes", "3",
                    "--modes", "longstraw"], check=True, capture_output=True, timeout=300)
    (pp2,) = json.loads((tmp_path / "pp2" / "bench_qwen3.5-debug.json").read_text())["results"]
    assert pp2["pipeline_parallel"] == 2 and len(pp2["replay_s"]) == 3 and len(pp2["stage_floor_gib"]) == 2
    assert all(0 < floor < cp1["floor_gib"] for floor in pp2["stage_floor_gib"])
    assert "Per pipeline stage" in (tmp_path / "pp2" / "bench_qwen3.5-debug.md").read_text()


def test_largest_prompt_fit_is_the_line_through_the_peaks():
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_longstraw import largest_prompt_fits

    rows = [dict(mode="longstraw", context_parallel=2, group=8, prompt_length=p, peak_gib=10 + p / 2**20,
                 device_gib=140.0) for p in (2**19, 2**20)]
    (fit,) = largest_prompt_fits(rows + [dict(rows[0], oom=True, prompt_length=2**23)])
    assert abs(fit["fixed_gib"] - 10) < 1e-9 and abs(fit["per_1k_mib"] - 1.0) < 1e-9
    assert fit["largest_prompt"] == 130 * 2**20
    capped = [dict(r, memory_limit_gib=30.0) for r in rows]  # --memory-limit-gb: the cap is the memory
    (fit,) = largest_prompt_fits(capped)
    assert fit["device_gib"] == 30.0 and fit["largest_prompt"] == 20 * 2**20


def test_memory_limit_is_checked_and_planned_for():
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_longstraw import _planned, parse_args

    with pytest.raises(ValueError, match="--memory-limit-gb 0.0: must be positive"):
        parse_args(["--memory-limit-gb", "0"])
    hf = resolve_hf_config("qwen3.5-0.8b")
    whole = _planned(hf, 2**18, 2, parse_args(["--prompt-gradient", "exact"]))
    capped = parse_args(["--prompt-gradient", "exact", "--memory-limit-gb", "32"])
    from megatron_longstraw.planning.measured import bench_plan
    from megatron_longstraw.planning.planner import model_profile

    plan = bench_plan(model_profile(hf), cp=1, pp=1, vpp=1, prompt_length=2**18, response_length=8192, group=2,
                      prompt_gradient="exact", chunk_size=32768, micro_batch_size=1, memory_gib=32e9 / 2**30)
    assert plan.gpu_memory_gib == 32e9 / 2**30 and not plan.fits  # ~58 GiB planned does not fit 29.8
    assert whole["fits"] and _planned(hf, 2**18, 2, capped) == dict(whole, fits=False)


def test_trainer_capture_mfu_covers_both_families(monkeypatch):
    """The trainer's capture MFU uses the family's FLOPs formula (GLM-5 too), a CP rank counting
    its 1/CP share; replay MFU stays Qwen3.5-only (no GLM replay formula)."""

    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import destroy_distributed, init_distributed
    from megatron_longstraw.longstraw.cost_model import prompt_flops
    from megatron_longstraw.testing.parity import seeded_model
    from megatron_longstraw.training import metrics

    init_distributed(ParallelSizes(), seed=1)
    try:
        groups = [{"prompt/length": 100, "tokens/response": 30}, {"prompt/length": 60, "tokens/response": 20}]
        times = {"time/capture_s": 2.0, "time/replay_s": 4.0}
        for preset in ("glm-5-debug", "qwen3.5-debug"):
            hf = resolve_hf_config(preset)
            model = seeded_model(hf)  # built before CUDA is faked (HF picks its kernels once)
            with monkeypatch.context() as patch:
                patch.setattr(metrics.torch.cuda, "is_available", lambda: True)
                out = metrics.throughput_metrics(hf, model, groups, times, peak_tflops=1.0)
            want = (prompt_flops(hf, model, 100) + prompt_flops(hf, model, 60)) / 2.0 / 1e12
            assert abs(out["mfu/capture"] - want) <= 1e-12 * want
            assert ("mfu/replay" in out) == preset.startswith("qwen")
    finally:
        destroy_distributed()


def test_linear_fp8_bench_needs_a_gpu_and_transformer_engine():
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_linear_fp8 import parse_args

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the tool runs (GPU host)")
    with pytest.raises(ValueError, match="needs a CUDA GPU and Transformer Engine"):
        parse_args(["--model", "qwen3.5-debug"])


def test_exact_gradient_check_tells_exact_from_detached(tmp_path):
    """``tools/exact_gradient_check.py`` at a tiny size (fp32, CPU): exact mode's gradient is the
    full graph's (cosine 1 to fp32 rounding, every counted tensor), the detached one is not."""
    sys.path.insert(0, str(ROOT / "tools"))
    import exact_gradient_check

    exact_gradient_check.main(["--model", "qwen3.5-debug", "--prompt-length", "70", "--group-size", "2",
                               "--response-length", "9", "--prompt-chunk-size", "32", "--output-dir", str(tmp_path)])
    result = json.loads((tmp_path / "exact_gradient_qwen3.5-debug.json").read_text())["result"]
    exact, detached = result["exact_vs_full"], result["detached_vs_full"]
    assert exact["whole"] > 1 - 1e-6 and exact["worst"] > 1 - 1e-4 and not exact["below_0_99"]
    assert exact["tensors"] > exact["of"] // 2
    assert detached["whole"] < 0.999 and detached["below_0_99"]
    assert "| exact vs full graph |" in (tmp_path / "exact_gradient_qwen3.5-debug.md").read_text()


def test_fp8_attention_bench_end_to_end(tmp_path):
    """tools/bench_fp8_attention.py on the emulated cuDNN kernel (CPU): a row per length, the FP8
    capture moves the log-probs and the gradients a little but not much, and where the exact
    emulation runs beside it the orchestration lands where the ideal FP8 kernel does."""
    cmd = [ROOT / "tools/bench_fp8_attention.py", "--model", "qwen3.5-debug",
           "--prompt-lengths", "96", "--emulation-prompt-lengths", "160", "--prompt-chunk-size", "64",
           "--emulation-chunk-size", "48", "--response-length", "8", "--num-generations", "2",
           "--warmup-prompt-length", "0",
           "--fp8-kernel", "emulated", "--output-dir", str(tmp_path)]
    run_script(cmd[0], cmd[1:], cwd=ROOT, check=True)
    data = json.loads((tmp_path / "fp8_attention_qwen3.5-debug.json").read_text())
    assert "tools/bench_fp8_attention.py" in data["command"]
    first, second = data["rows"]
    assert (first["prompt_length"], first["chunk"], second["prompt_length"], second["chunk"]) == (96, 64, 160, 48)
    assert "emulation" not in first
    for row in (first["fp8"], second["fp8"], second["emulation"]):
        assert 0 < row["logprob_mean_abs"] < 0.1 and 0 < row["loss_rel_err"] < 1e-3, row
        assert 0.9 < row["cosine"] <= 1.0, row
    assert abs(second["fp8"]["cosine"] - second["emulation"]["cosine"]) < 0.02, second
    assert "| FP8 emulation |" in (tmp_path / "fp8_attention_qwen3.5-debug.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a CUDA GPU")
def test_fp8_attention_bench_names_the_flag_without_a_gpu(tmp_path):
    cmd = [ROOT / "tools/bench_fp8_attention.py", "--model", "qwen3.5-debug",
           "--prompt-lengths", "64", "--emulation-prompt-lengths", "", "--output-dir", str(tmp_path)]
    bad = run_script(cmd[0], cmd[1:], cwd=ROOT)
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].startswith("error: --fp8-attention capture needs a CUDA GPU"), bad.stderr
    assert not list(tmp_path.iterdir())  # nothing written
