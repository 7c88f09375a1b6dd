"""Benchmark plumbing: FLOPs formula, saved-activation meter, and the bench tool end to end."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from megatron_longstraw.longstraw.activation_meter import SavedTensorMeter
from megatron_longstraw.longstraw.cost_model import memory_floor_bytes, qwen_prompt_flops
from megatron_longstraw.models.presets import resolve_hf_config

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


def test_bench_tool_end_to_end(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools/bench_longstraw.py"), "--model", "qwen3.5-debug",
           "--prompt-lengths", "96", "--group-sizes", "1,3", "--response-length", "16",
           "--prompt-chunk-size", "32", "--warmup-prompt-length", "40", "--output-dir", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    data = json.loads((tmp_path / "bench_qwen3.5-debug.json").read_text())
    assert "tools/bench_longstraw.py" in data["command"]
    modes = sorted((r["mode"], r["group"]) for r in data["results"])
    assert modes == [("full", 1), ("longstraw", 1), ("longstraw", 3)]
    assert (tmp_path / "bench_qwen3.5-debug.png").stat().st_size > 1000
    assert "Command: `" in (tmp_path / "bench_qwen3.5-debug.md").read_text()
