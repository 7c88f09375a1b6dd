"""The export loop: an HF folder with its tokenizer and generation config, converted, trained a
step, exported by mcore-to-hf, loads in transformers with its tokenizer and generates (CPU)."""

import json
import sys
from pathlib import Path

import pytest
import torch

import train_grpo
from megatron_longstraw.config.data import DataConfig
from megatron_longstraw.config.trainer import TrainerConfig
from megatron_longstraw.config.training import CheckpointConfig
from megatron_longstraw.distributed import destroy_distributed, init_distributed
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.hf_reference import build_hf_model, hf_model_class
from megatron_longstraw.training import loop
from megatron_longstraw.training.checkpoint import run_assets

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import convert_checkpoint  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "answer", "is"]


def _save_tokenizer(folder: Path) -> Path:
    """A word-level HF tokenizer made here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<bos>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>",
                            eos_token="<eos>").save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(HF source folder, converted checkpoint, trained run's save dir, exported folder)."""
    from transformers import GenerationConfig

    tmp = tmp_path_factory.mktemp("export")
    hf = resolve_hf_config("qwen3.5-debug")
    hf.pop("_source", None)
    build_hf_model(hf, seed=3).save_pretrained(tmp / "hf")
    _save_tokenizer(tmp / "hf")
    GenerationConfig(eos_token_id=2, bos_token_id=1, do_sample=True, temperature=0.7, top_p=0.9).save_pretrained(tmp / "hf")
    assert convert_checkpoint.main(["hf-to-mcore", "--load", str(tmp / "hf"), "--save", str(tmp / "mcore"),
                                    "--no-progress"]) == 0
    args = train_grpo.parse_args([
        "--train-iters", "1", "--wandb-mode", "disabled", "--global-batch-size", "1", "--num-generations", "2",
        "--synthetic-prompt-length", "24", "--prompt-chunk-size", "24", "--max-response-length", "2",
        "--lr", "1e-2", "--save", str(tmp / "run"), "--wandb-save-dir", str(tmp / "wandb"),
        "--pretrained-checkpoint", str(tmp / "mcore")])
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        loop.train(args)
    finally:
        destroy_distributed()
    assert convert_checkpoint.main(["mcore-to-hf", "--load", str(tmp / "run"), "--save", str(tmp / "out"),
                                    "--no-progress"]) == 0
    return tmp / "hf", tmp / "mcore", tmp / "run", tmp / "out"


def test_the_files_travel_from_source_to_export(exported):
    source, converted, run, out = exported
    names = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for folder in (converted / "hf_assets", run / "iter_0000001" / "hf_assets", out):
        for name in names:
            assert (folder / name).read_bytes() == (source / name).read_bytes(), (folder, name)


def test_the_exported_folder_loads_with_its_tokenizer_and_generates(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, _, _, out = exported
    hf_model_class(json.loads((out / "config.json").read_text())["model_type"])  # torch kernels on CPU
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert tokenizer.eos_token_id == 2 and model.generation_config.eos_token_id == 2
    assert model.generation_config.temperature == 0.7
    inputs = tokenizer("the answer is alpha", return_tensors="pt")
    torch.manual_seed(0)
    generated = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4)
    assert generated.shape == (1, inputs["input_ids"].shape[1] + 4)
    assert isinstance(tokenizer.decode(generated[0]), str)


def test_run_assets_take_the_tokenizer_the_run_used(exported, tmp_path):
    source, converted, _, _ = exported
    other = _save_tokenizer(tmp_path / "other")
    config = TrainerConfig(checkpoint=CheckpointConfig(pretrained_checkpoint=str(converted)),
                           data=DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(other)))
    assets = run_assets(config, load=None)
    assert assets["tokenizer.json"] == (other / "tokenizer.json").read_bytes()  # the run's tokenizer
    assert assets["generation_config.json"] == (converted / "hf_assets" / "generation_config.json").read_bytes()


def test_another_tokenizer_replaces_the_kept_one_whole():
    from megatron_longstraw.checkpointing.hf_assets import override_assets

    kept = {"tokenizer.json": "a/tokenizer.json", "chat_template.jinja": "a/chat_template.jinja",
            "tokenizer_config.json": "a/tokenizer_config.json", "generation_config.json": "a/generation_config.json"}
    bpe = {"vocab.json": "b/vocab.json", "merges.txt": "b/merges.txt", "tokenizer_config.json": "b/tokenizer_config.json"}
    assert override_assets(kept, bpe) == {**bpe, "generation_config.json": "a/generation_config.json"}
    assert override_assets(kept, {}) == kept
    null = run_assets(TrainerConfig(), load=None)
    assert null == {}


def test_export_flag_errors_are_one_line(exported, tmp_path, capsys):
    _, _, run, _ = exported
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert_checkpoint.main(["mcore-to-hf", "--load", str(run), "--save", str(tmp_path / "x"),
                                    "--tokenizer-model", str(empty)]) == 2
    assert capsys.readouterr().err.strip() == f"error: --tokenizer-model {empty}: no tokenizer files there " \
                                              "(tokenizer.json, tokenizer_config.json, ...)"
    assert not (tmp_path / "x").exists()
