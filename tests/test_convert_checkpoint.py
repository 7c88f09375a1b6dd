"""tools/convert_checkpoint.py: HF <-> Megatron distributed checkpoints, both families (CPU)."""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_longstraw.checkpointing.model_checkpoint import load_model_checkpoint
from megatron_longstraw.models.builder import build_model
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.registry import all_presets
from megatron_longstraw.testing.hf_reference import build_hf_model, hf_model_class
from megatron_longstraw.testing.multiprocess import run_multiprocess, run_script
from megatron_longstraw.testing.parity import forward_logits

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import convert_checkpoint  # noqa: E402

CASES = {"qwen": ("qwen3.5-debug", {"tie_word_embeddings": True}),
         "glm": ("glm-5-debug", {})}  # (Qwen3.5-MoE's conversion: tests/test_mtp_weights.py, test_qwen3_5_moe.py)


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() \
        else {"model.safetensors"}
    out = {}
    for file in files:
        out.update(load_file(folder / file))
    return out


def _stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Routed experts one tensor per expert (``mlp.experts.{e}.gate_proj.weight``: transformers'
    ``save_pretrained``) as the stacked ``gate_up_proj`` / ``down_proj`` the official Qwen3.5-MoE
    checkpoints and their exports hold; other tensors unchanged."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"(.+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(match.group(1), {}).setdefault(int(match.group(2)), {})[match.group(3)] = tensor
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["gate"], by_expert[e]["up"]])
                                                    for e in order])
        out[prefix + "down_proj"] = torch.stack([by_expert[e]["down"] for e in order])
    return out


def _assert_bit_identical(original: Path, converted: Path) -> None:
    """The same tensors, bit for bit (routed experts compared in one layout: ``_stacked_experts``)."""
    a, b = _stacked_experts(_hf_tensors(original)), _stacked_experts(_hf_tensors(converted))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    """(hf config, HF model, HF folder, Megatron folder) for each family."""
    preset, overrides = CASES[request.param]
    hf = dict(copy.deepcopy(all_presets()[preset]), **overrides)
    hf_model = build_hf_model(hf, seed=3)
    root = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(root / "hf", max_shard_size="200KB")
    assert len(list((root / "hf").glob("*.safetensors"))) > 1
    assert convert_checkpoint.main(["hf-to-mcore", "--load", str(root / "hf"),
                                    "--save", str(root / "mcore"), "--no-progress"]) == 0
    return hf, hf_model, root


def test_hf_to_mcore_logits_match_hf(single_process, converted):
    hf, hf_model, root = converted
    model = build_model(hf, ModelOptions(), parallel_output=False)
    load_model_checkpoint(model, root / "mcore")
    tokens = torch.randint(0, hf["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        actual = forward_logits(model.eval(), tokens)
    assert (actual - expected).abs().max().item() <= 1e-4
    assert expected.abs().max().item() > 1e-2


def test_mcore_to_hf_is_bit_identical_and_loads(converted):
    hf, hf_model, root = converted
    out = root / "back"
    assert convert_checkpoint.main(["mcore-to-hf", "--load", str(root / "mcore"), "--save", str(out),
                                    "--max-shard-size", "300KB", "--no-progress"]) == 0
    _assert_bit_identical(root / "hf", out)
    model_cls, _ = hf_model_class(hf["model_type"])
    loaded = model_cls.from_pretrained(out, torch_dtype=torch.float32).eval()
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def _tp2_load_and_save(hf, load_dir, save_dir):
    from megatron_longstraw.checkpointing.model_checkpoint import save_model_checkpoint
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed

    init_distributed(ParallelSizes(tensor=2))
    model = build_model(hf, ModelOptions(sequence_parallel=True))
    load_model_checkpoint(model, load_dir)
    save_model_checkpoint(model, save_dir)
    return True


def test_tp2_checkpoint_reads_back_under_tp1(converted):
    """Load the converted checkpoint under TP=2 (gloo), save it there, convert it back at TP=1."""
    hf, _, root = converted
    saved = root / "tp2"
    assert run_multiprocess(_tp2_load_and_save, 2, hf, root / "mcore", saved) == [True, True]
    (root / "run").mkdir()  # a Megatron save directory around the TP=2 checkpoint
    saved.rename(root / "run" / "iter_0000007")
    (root / "run" / "latest_checkpointed_iteration.txt").write_text("7")
    assert convert_checkpoint.main(["mcore-to-hf", "--load", str(root / "run"),
                                    "--save", str(root / "back_tp2"), "--no-progress"]) == 0
    _assert_bit_identical(root / "hf", root / "back_tp2")


# ----------------------------------------------------------------------------- bad input


def _cli(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()  # not this process's process-group settings
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return run_script(ROOT / "tools" / "convert_checkpoint.py", [*args, "--no-progress"], cwd=ROOT,
                      env=dict(env, PYTHONWARNINGS="ignore"))


def _copy_hf(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)  # (a converted checkpoint keeps its HF assets in a subfolder)
    return dst


def _edit_index(folder: Path, fn) -> None:
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    fn(data["weight_map"])
    index.write_text(json.dumps(data))


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _missing_shard(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.1.input_layernorm.weight"]
    (folder / shard).unlink()
    return shard


def _missing_index_entry(folder):
    _edit_index(folder, lambda m: m.pop("model.layers.1.input_layernorm.weight"))
    return "model.layers.1.input_layernorm.weight"


def _unknown_model_type(folder):
    _edit_config(folder, model_type="llama_xyz")
    return "llama_xyz"


def _shape_mismatch(folder):
    _edit_config(folder, intermediate_size=96)
    return "mlp"


def _extra_tensor(folder):
    save_file({"model.layers.0.mlp.extra.weight": torch.zeros(2)}, folder / "extra.safetensors",
              metadata={"format": "pt"})
    _edit_index(folder, lambda m: m.update({"model.layers.0.mlp.extra.weight": "extra.safetensors"}))
    return "model.layers.0.mlp.extra.weight"


@pytest.mark.parametrize("breaker", [_missing_shard, _missing_index_entry, _unknown_model_type,
                                     _shape_mismatch, _extra_tensor])
def test_bad_input_one_line_error_and_nothing_left(converted, tmp_path, breaker, capsys):
    hf, _, root = converted
    if breaker is _shape_mismatch and hf["model_type"] != "qwen3_5_text":
        pytest.skip("one family suffices")
    broken = _copy_hf(root / "hf", tmp_path / "broken")
    named = breaker(broken)
    capsys.readouterr()
    status = convert_checkpoint.main(["hf-to-mcore", "--load", str(broken), "--save", str(tmp_path / "out"),
                                      "--no-progress"])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert status == 2, stderr[-2000:]
    assert len(lines) == 1 and named in lines[0], stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def test_the_command_line_exits_with_the_error_status(converted, tmp_path):
    """The script itself (not ``main``): a bad --load is one error line and exit status 2."""
    if converted[0]["model_type"] != "qwen3_5_text":
        pytest.skip("one family suffices")
    result = _cli("hf-to-mcore", "--load", str(tmp_path / "absent"), "--save", str(tmp_path / "out"))
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1 and "absent" in lines[0], result.stderr[-2000:]


def test_truncated_checkpoint_to_hf_is_one_line_naming_the_file(converted, tmp_path, capsys):
    hf, _, root = converted
    if hf["model_type"] != "qwen3_5_text":
        pytest.skip("one family suffices")
    broken = _copy_hf(root / "mcore", tmp_path / "broken")
    data = broken / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    capsys.readouterr()
    assert convert_checkpoint.main(["mcore-to-hf", "--load", str(broken), "--save", str(tmp_path / "out"),
                                    "--no-progress"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert lines == [f"error: --load {broken}: checkpoint is corrupt or incomplete: __0_0.distcp is truncated "
                     f"(1000 bytes; its index needs {(root / 'mcore' / '__0_0.distcp').stat().st_size})"], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def test_existing_output_needs_overwrite(converted, tmp_path):
    _, _, root = converted
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    assert convert_checkpoint.main(["mcore-to-hf", "--load", str(root / "mcore"),
                                    "--save", str(out), "--no-progress"]) == 2
    assert (out / "keep").exists()
    assert convert_checkpoint.main(["mcore-to-hf", "--load", str(root / "mcore"), "--save",
                                    str(out), "--overwrite", "--no-progress"]) == 0
    assert not (out / "keep").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]



def _load_under_layout(hf, load_dir, hf_state, sizes):
    """This rank's weights loaded from the checkpoint vs mapped directly from the HF weights."""
    from megatron_longstraw.distributed import init_distributed
    from megatron_longstraw.models.builder import load_full_state_dict
    from megatron_longstraw.models.registry import family_for

    init_distributed(sizes)
    options = ModelOptions(sequence_parallel=sizes.tensor > 1)
    from_checkpoint, from_hf = build_model(hf, options), build_model(hf, options)
    load_model_checkpoint(from_checkpoint, load_dir)
    load_full_state_dict(from_hf, family_for(hf["model_type"]).weights.hf_to_mcore(hf_state, hf))
    expected = {k: v for k, v in from_hf.state_dict().items() if not k.endswith("_extra_state")}
    actual = {k: v for k, v in from_checkpoint.state_dict().items() if not k.endswith("_extra_state")}
    assert sorted(actual) == sorted(expected)
    return [name for name in expected if not torch.equal(actual[name], expected[name])]


def test_converted_checkpoint_loads_under_expert_parallelism(converted):
    """GLM-5: EP=2 ranks each load their own experts (and the router bias) exactly."""
    from megatron_longstraw.config.parallel import ParallelSizes

    hf, hf_model, root = converted
    if hf["model_type"] != "glm_moe_dsa":
        pytest.skip("a dense model: no experts")
    mismatched = run_multiprocess(_load_under_layout, 2, hf, root / "mcore", hf_model.state_dict(),
                                  ParallelSizes(expert=2))
    assert mismatched == [[], []]


def _load_under_pipeline(hf, load_dir, hf_state):
    """PP=2: each stage's weights from the checkpoint vs the HF mapping at global layer numbers."""
    import re

    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import init_distributed
    from megatron_longstraw.models.pipeline_stage import local_layer_ids
    from megatron_longstraw.models.registry import family_for

    init_distributed(ParallelSizes(pipeline=2))
    model = build_model(hf, ModelOptions())
    load_model_checkpoint(model, load_dir)
    full = family_for(hf["model_type"]).weights.hf_to_mcore(hf_state, hf)
    layer_ids = local_layer_ids(model.config)
    mismatched = []
    for name, param in model.named_parameters():
        match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        key = f"decoder.layers.{layer_ids[int(match.group(1))]}.{match.group(2)}" if match else name
        if key == "output_layer.weight" and key not in full:  # tied: the last stage's copy
            key = "embedding.word_embeddings.weight"
        if not torch.equal(param, full[key]):
            mismatched.append(name)
    return layer_ids, mismatched


def test_converted_checkpoint_loads_under_pipeline_parallelism(converted):
    """Qwen3.5 (tied embeddings: the last stage's output layer comes from the embedding)."""
    hf, hf_model, root = converted
    if hf["model_type"] == "glm_moe_dsa":
        pytest.skip("glm-5-debug's shared-indexer pattern has no valid even 2-stage split "
                    "(Megatron refuses it); GLM-5 pipeline layouts come with PP support")
    results = run_multiprocess(_load_under_pipeline, 2, hf, root / "mcore", hf_model.state_dict())
    layers = hf["num_hidden_layers"]
    assert [ids for ids, _ in results] == [list(range(layers // 2)), list(range(layers // 2, layers))]
    assert [bad for _, bad in results] == [[], []]


def test_multimodal_qwen_checkpoint_converts_both_ways(tmp_path):
    """A ``qwen3_5`` (multimodal) folder: text model under ``model.language_model.``, its config
    nested in ``text_config``, a vision tower beside it. hf-to-mcore takes the text model,
    mcore-to-hf writes it back as ``Qwen3_5ForCausalLM`` with the same tensors."""
    hf = dict(copy.deepcopy(all_presets()["qwen3.5-debug"]), tie_word_embeddings=True)
    build_hf_model(hf, seed=4).save_pretrained(tmp_path / "text")
    text = _hf_tensors(tmp_path / "text")
    config = json.loads((tmp_path / "text" / "config.json").read_text())
    wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "tie_word_embeddings": True, "vision_config": {"depth": 1},
               "text_config": {k: v for k, v in config.items() if k not in ("architectures", "tie_word_embeddings")}}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(wrapped))
    tensors = {name.replace("model.", "model.language_model.", 1): t for name, t in text.items()}
    save_file(dict(tensors, **{"model.visual.patch_embed.proj.weight": torch.ones(4, 3)}),
              tmp_path / "hf" / "model.safetensors")
    assert convert_checkpoint.main(["hf-to-mcore", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "mcore"),
                                    "--no-progress"]) == 0
    assert convert_checkpoint.main(["mcore-to-hf", "--load", str(tmp_path / "mcore"), "--save", str(tmp_path / "back"),
                                    "--no-progress"]) == 0
    back = _hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(text)
    assert all(torch.equal(back[name], text[name]) for name in text)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "qwen3_5_text"
