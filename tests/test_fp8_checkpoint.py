"""Block-scaled FP8 checkpoints (``checkpointing/fp8_blocks.py``): dequantized on import exactly as
transformers' loader and a by-hand loop do; bad scales refused in one line naming the file (CPU)."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_longstraw.checkpointing.fp8_blocks import dequantize_blocks
from megatron_longstraw.models.registry import all_presets
from megatron_longstraw.testing.hf_reference import build_hf_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import convert_checkpoint  # noqa: E402

BLOCK = (16, 16)  # the published 128 x 128, scaled down with the model


def _quantize(weight_RC: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 blocks and their fp32 ``scale_inv`` (block amax / 448), as FP8 checkpoints are made."""
    rows, cols = weight_RC.shape
    scale_rc = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    q_RC = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for r in range(scale_rc.shape[0]):
        for c in range(scale_rc.shape[1]):
            part = weight_RC[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]].float()
            scale_rc[r, c] = part.abs().max().clamp(min=1e-12) / 448.0
            q_RC[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]] = \
                (part / scale_rc[r, c]).to(torch.float8_e4m3fn)
    return q_RC, scale_rc


def _by_hand(q_RC: torch.Tensor, scale_rc: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """Element by element: ``q * scale of its block`` in fp32, rounded to bf16."""
    out = torch.empty(q_RC.shape, dtype=torch.bfloat16)
    for i in range(q_RC.shape[0]):
        for j in range(q_RC.shape[1]):
            out[i, j] = (q_RC[i, j].float() * scale_rc[i // block[0], j // block[1]]).to(torch.bfloat16)
    return out


def test_dequantization_equals_transformers_and_by_hand():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(0)
    for shape in ((64, 48), (37, 21)):  # whole blocks; ragged last blocks
        q_RC, scale_rc = _quantize(torch.randn(*shape, generator=gen) * 3)
        ours = dequantize_blocks(q_RC, scale_rc, BLOCK)
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, _by_hand(q_RC, scale_rc))
        if shape[0] % BLOCK[0] == 0 and shape[1] % BLOCK[1] == 0:  # (transformers takes whole blocks only)
            reference = Fp8Dequantize(None)._dequantize_one(q_RC, scale_rc, output_dtype=torch.bfloat16)
            assert torch.equal(ours, reference)


def _fp8_folder(folder: Path) -> tuple[Path, dict, dict]:
    """qwen3.5-debug saved by transformers, its linear weights (2-D ``*proj*.weight``) stored as
    E4M3 blocks with ``weight_scale_inv``: ``(folder, original tensors, quantized names)``."""
    hf = dict(all_presets()["qwen3.5-debug"])
    build_hf_model(hf, seed=6).save_pretrained(folder / "bf16")
    tensors = load_file(folder / "bf16" / "model.safetensors")
    out, quantized = {}, {}
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and "proj" in name and name.endswith(".weight"):
            q_RC, scale_rc = _quantize(tensor)
            out[name], out[name + "_scale_inv"] = q_RC, scale_rc
            quantized[name] = _by_hand(q_RC, scale_rc)
        else:
            out[name] = tensor
    (folder / "fp8").mkdir()
    save_file(out, folder / "fp8" / "model.safetensors")
    config = json.loads((folder / "bf16" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK),
                                     "activation_scheme": "dynamic", "fmt": "e4m3"}
    (folder / "fp8" / "config.json").write_text(json.dumps(config))
    return folder / "fp8", tensors, quantized


def test_fp8_checkpoint_converts_to_the_dequantized_weights(tmp_path):
    source, original, quantized = _fp8_folder(tmp_path)
    assert any(t.shape[0] % BLOCK[0] for t in quantized.values())  # ragged blocks among them (in_proj_b/a)
    assert convert_checkpoint.main(["hf-to-mcore", "--load", str(source), "--save", str(tmp_path / "mcore"),
                                    "--no-progress"]) == 0
    assert convert_checkpoint.main(["mcore-to-hf", "--load", str(tmp_path / "mcore"), "--save", str(tmp_path / "back"),
                                    "--no-progress"]) == 0
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        expected = quantized.get(name, tensor)
        assert back[name].dtype == expected.dtype and torch.equal(back[name], expected), name
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())


def _break(source: Path, how: str) -> str:
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    if how == "missing scale":
        del tensors["model.layers.0.mlp.down_proj.weight_scale_inv"]
        wanted = "FP8 weight 'model.layers.0.mlp.down_proj.weight' has no 'model.layers.0.mlp.down_proj.weight_scale_inv'"
    elif how == "scale shape":
        tensors["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(1, 1)
        wanted = "'model.layers.0.mlp.down_proj.weight_scale_inv' has shape (1, 1)"
    elif how == "orphan scale":
        tensors["model.norm.weight_scale_inv"] = torch.ones(1)
        wanted = "scale 'model.norm.weight_scale_inv' belongs to no FP8 weight"
    else:
        config["quantization_config"]["quant_method"] = "awq"
        wanted = "config.json: quantization_config.quant_method 'awq' is not supported"
    save_file(tensors, source / "model.safetensors")
    (source / "config.json").write_text(json.dumps(config))
    return wanted


@pytest.mark.parametrize("how", ["missing scale", "scale shape", "orphan scale", "method"])
def test_bad_fp8_checkpoint_is_one_line_naming_the_file(how, tmp_path, capsys):
    source, _, _ = _fp8_folder(tmp_path)
    wanted = _break(source, how)
    capsys.readouterr()  # (the model's save)
    assert convert_checkpoint.main(["hf-to-mcore", "--load", str(source), "--save", str(tmp_path / "mcore"),
                                    "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and wanted in err[0] and str(source) in err[0], err
    assert not (tmp_path / "mcore").exists()
