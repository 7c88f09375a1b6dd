"""Bad input: one clear error line naming the flag/field/file, and a non-zero exit."""

import json
from pathlib import Path

import pytest

from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.distributed import init_distributed
from megatron_longstraw.models.builder import build_model
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.models.qwen3_5.presets import PRESETS
from megatron_longstraw.models.registry import family_for
from megatron_longstraw.testing.multiprocess import run_multiprocess, run_script

ROOT = Path(__file__).resolve().parents[1]


def _run_smoke(*args):
    proc = run_script(ROOT / "examples/smoke_forward_backward.py", list(args))
    return proc.returncode, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""


def test_unknown_model_type():
    with pytest.raises(ValueError, match=r"unknown model_type 'llama'; supported: .*qwen3_5"):
        family_for("llama")


def test_missing_config_field_names_field_and_file(tmp_path):
    config = dict(PRESETS["qwen3.5-debug"])
    del config["linear_num_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, last = _run_smoke("--model", str(tmp_path))
    assert code != 0
    assert last == f"error: {tmp_path}/config.json: missing field 'linear_num_value_heads' required by Qwen3.5"


def test_invalid_json_names_line(tmp_path):
    (tmp_path / "config.json").write_text('{\n  "model_type": "qwen3_5_text",\n  oops\n}')
    with pytest.raises(ValueError, match=r"config.json:3: invalid JSON"):
        resolve_hf_config(str(tmp_path))


def test_transformer_engine_requested_but_absent():
    pytest.importorskip("megatron")
    try:
        import transformer_engine.pytorch  # noqa: F401
        pytest.skip("Transformer Engine is installed here")
    except ImportError:
        pass
    code, last = _run_smoke("--model", "qwen3.5-debug", "--transformer-impl", "transformer_engine")
    assert code != 0
    assert last == "error: --transformer-impl transformer_engine needs Transformer Engine, which is not installed"


def _build_with_tp2(hf):
    init_distributed(ParallelSizes(tensor=2))
    try:
        build_model(hf)
    except ValueError as err:
        return str(err)
    return None


def test_heads_not_divisible_by_tp():
    hf = resolve_hf_config("qwen3.5-debug")
    hf.update(num_attention_heads=6, num_key_value_heads=3)
    messages = run_multiprocess(_build_with_tp2, 2, hf)
    assert messages == ["num_key_value_heads (3) is not divisible by --tensor-model-parallel-size 2"] * 2


def test_world_size_not_divisible():
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by tensor \(2\)"):
        ParallelSizes(tensor=2).validate(3)
