"""Multi-token-prediction tensors (both families): hf-to-mcore keeps them unchanged beside the
Megatron weights, the trainer's saves carry them, mcore-to-hf writes them back, so the export is
the published checkpoint with the trained weights (CPU)."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import train_grpo
from megatron_longstraw.distributed import destroy_distributed, init_distributed
from megatron_longstraw.models.registry import all_presets
from megatron_longstraw.testing.hf_reference import build_hf_model, hf_model_class
from megatron_longstraw.training import loop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import convert_checkpoint  # noqa: E402


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _mtp(hidden: int, prefix: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One MTP layer's worth of tensors under ``prefix`` (bf16 and fp32, as published)."""
    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator).to(dtype)
    return {f"{prefix}fc.weight" if prefix == "mtp." else f"{prefix}eh_proj.weight": rand(hidden, 2 * hidden),
            f"{prefix}norm.weight" if prefix == "mtp." else f"{prefix}enorm.weight": rand(hidden, dtype=torch.float32),
            f"{prefix}layers.0.input_layernorm.weight" if prefix == "mtp." else f"{prefix}hnorm.weight": rand(hidden),
            f"{prefix}layers.0.mlp.down_proj.weight" if prefix == "mtp." else f"{prefix}mlp.down_proj.weight":
                rand(hidden, 3 * hidden)}


def qwen_folder(folder: Path, layers: int = 1, preset: str = "qwen3.5-debug", wrapper: str = "qwen3_5",
                architecture: str = "Qwen3_5ForConditionalGeneration") -> tuple[Path, dict]:
    """A ``Qwen3_5ForConditionalGeneration``-style folder: text model under
    ``model.language_model.``, a vision tensor, ``mtp.*`` tensors; ``mtp_num_hidden_layers: layers``."""
    hf = dict(copy.deepcopy(all_presets()[preset]), tie_word_embeddings=False)
    build_hf_model(hf, seed=4).save_pretrained(folder / "text")
    config = json.loads((folder / "text" / "config.json").read_text())
    text_config = {k: v for k, v in config.items() if k not in ("architectures", "tie_word_embeddings")}
    wrapped = {"model_type": wrapper, "architectures": [architecture],
               "tie_word_embeddings": False, "vision_config": {"depth": 1},
               "text_config": dict(text_config, mtp_num_hidden_layers=layers)}
    (folder / "hf").mkdir()
    (folder / "hf" / "config.json").write_text(json.dumps(wrapped))
    text = {name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: t
            for name, t in _tensors(folder / "text").items()}
    mtp = _mtp(hf["hidden_size"], "mtp.", torch.Generator().manual_seed(7))
    save_file(dict(text, **mtp, **{"model.visual.patch_embed.proj.weight": torch.ones(4, 3)}),
              folder / "hf" / "model.safetensors")
    return folder / "hf", mtp


def glm_folder(folder: Path, layers: int = 1) -> tuple[Path, dict]:
    """glm-5-debug saved by transformers, plus its MTP layer ``model.layers.{num_hidden_layers}.*``
    in a shard of its own; ``num_nextn_predict_layers: layers``."""
    hf = copy.deepcopy(all_presets()["glm-5-debug"])
    build_hf_model(hf, seed=4).save_pretrained(folder / "hf", max_shard_size="200KB")
    config_path, index_path = folder / "hf" / "config.json", folder / "hf" / "model.safetensors.index.json"
    config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()), num_nextn_predict_layers=layers)))
    mtp = _mtp(hf["hidden_size"], f"model.layers.{hf['num_hidden_layers']}.", torch.Generator().manual_seed(7))
    save_file(mtp, folder / "hf" / "mtp.safetensors")
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: "mtp.safetensors" for name in mtp})
    index_path.write_text(json.dumps(index))
    return folder / "hf", mtp


def qwen_moe_folder(folder: Path, layers: int = 1) -> tuple[Path, dict]:
    """The same for ``Qwen3_5MoeForConditionalGeneration`` (``qwen3_5_moe``)."""
    return qwen_folder(folder, layers, "qwen3.5-moe-debug", "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")


FOLDERS = {"qwen": qwen_folder, "glm": glm_folder, "qwen-moe": qwen_moe_folder}


@pytest.mark.parametrize("family", sorted(FOLDERS))
def test_mtp_tensors_survive_conversion_training_and_export(family, tmp_path):
    source, mtp = FOLDERS[family](tmp_path)
    assert convert_checkpoint.main(["hf-to-mcore", "--load", str(source), "--save", str(tmp_path / "mcore"),
                                    "--no-progress"]) == 0
    argv = ["--train-iters", "1", "--global-batch-size", "1", "--num-generations", "3",
            "--synthetic-prompt-length", "24", "--prompt-chunk-size", "24", "--max-response-length", "5",
            "--lr", "1e-2", "--reward-fn", "reward_fixtures:low_token_fraction", "--wandb-mode", "disabled",
            "--wandb-save-dir", str(tmp_path / "wandb"),
            "--save", str(tmp_path / "run"), "--pretrained-checkpoint", str(tmp_path / "mcore")]
    config = train_grpo.parse_args(argv)
    init_distributed(config.parallel.sizes, seed=config.training.seed)
    try:
        loop.train(config)
    finally:
        destroy_distributed()
    assert convert_checkpoint.main(["mcore-to-hf", "--load", str(tmp_path / "run"), "--save", str(tmp_path / "out"),
                                    "--max-shard-size", "100KB", "--no-progress"]) == 0
    out, before = _tensors(tmp_path / "out"), _tensors(source)
    for name, tensor in mtp.items():  # bit-identical, dtype included
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(mtp) <= set(index) and set(index) == set(out)
    before = {n.replace("model.language_model.", "model.", 1): t for n, t in before.items()}
    trained = [n for n in out if n not in mtp and n in before and not torch.equal(out[n], before[n])]
    assert trained, "the export holds the trained weights"
    config_out = json.loads((tmp_path / "out" / "config.json").read_text())
    model_cls, _ = hf_model_class(config_out["model_type"])
    loaded = model_cls.from_pretrained(tmp_path / "out", torch_dtype=torch.float32)  # (ignores the MTP tensors)
    assert not any(name in loaded.state_dict() for name in mtp)


@pytest.mark.parametrize("family", sorted(FOLDERS))
def test_mtp_layer_count_that_disagrees_with_the_config_is_one_line(family, tmp_path, capsys):
    source, _ = FOLDERS[family](tmp_path, layers=2)
    field = {"qwen": "mtp_num_hidden_layers", "qwen-moe": "mtp_num_hidden_layers",
             "glm": "num_nextn_predict_layers"}[family]
    assert convert_checkpoint.main(["hf-to-mcore", "--load", str(source), "--save", str(tmp_path / "mcore"),
                                    "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {source}: ") and f"config's {field} is 2" in err and "1 multi-token" in err, err
    assert not (tmp_path / "mcore").exists()
