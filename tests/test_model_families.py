"""Family knowledge behind the typed family contract (``models/family.py``'s ``ModelFamily``),
and families from outside the package (``use_family`` / ``--model-family``: a dotted module path
or a ``.py`` file naming a ``ModelFamily``)."""

import json
import sys

import pytest
import torch

from megatron_longstraw.longstraw.cost_model import prompt_flops, response_forward_flops
from megatron_longstraw.models.family import ModelFamily
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.models.qwen3_5.presets import PRESETS
from megatron_longstraw.models.registry import (builtin_model_types, family_for, load_family, register_family,
                                                supported_model_types, unregister_family, use_family)

TOY_TYPE = "toy_longstraw"
_FIELDS = [f for f in ModelFamily.__dataclass_fields__ if f not in ("name", "model_types")]


def _family_source(fields=None, model_types=(TOY_TYPE,)) -> str:
    """A family module: the Qwen3.5 family under its own model types, as README shows it (or a
    ``ModelFamily`` of only the Qwen3.5 family's ``fields``)."""
    head = ('"""A toy family: the Qwen3.5 family under its own model_type."""\n\n'
            "from dataclasses import replace\n\n"
            "from megatron_longstraw.models.family import ModelFamily\n"
            "from megatron_longstraw.models.qwen3_5 import FAMILY as QWEN\n\n")
    if fields is None:
        return head + f"FAMILY = replace(QWEN, name='toy', model_types={tuple(model_types)!r}, presets={{}})\n"
    given = ", ".join(f"{f}=QWEN.{f}" for f in fields)
    return head + f"FAMILY = ModelFamily(name='toy', model_types={tuple(model_types)!r}, {given})\n"


def _toy_config(folder) -> str:
    """A tiny ``config.json`` of the toy family (the sizes of ``qwen3.5-debug``) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(PRESETS["qwen3.5-debug"], model_type=TOY_TYPE)))
    return str(folder)


@pytest.fixture
def clean_registry():
    """Whatever a test registers is gone afterwards (no family leaks into other tests)."""
    yield
    for model_type in sorted(set(supported_model_types()) - set(builtin_model_types())):
        unregister_family(family_for(model_type))
    assert supported_model_types() == builtin_model_types() == ["glm_moe_dsa", "qwen3_5", "qwen3_5_moe",
                                                                   "qwen3_5_moe_text", "qwen3_5_text"]


def test_family_from_a_file_outside_the_package_builds_and_matches_hf(tmp_path, single_process, clean_registry):
    """A toy family file in ``tmp_path`` registers its model_type; a config of that type builds
    through the family, its forward equals the HF reference the family names, and the cost
    model asks the family for its FLOPs."""
    from megatron_longstraw.testing.hf_reference import build_hf_model
    from megatron_longstraw.testing.parity import forward_logits, megatron_from_hf

    path = tmp_path / "toy_family.py"
    path.write_text(_family_source())
    assert TOY_TYPE not in supported_model_types()
    family = use_family(str(path))
    assert family_for(TOY_TYPE) is family and family.name == "toy"
    assert use_family(str(path)) is family  # registering again changes nothing
    assert use_family(f"{path}:FAMILY") is family  # the attribute named
    hf = resolve_hf_config(_toy_config(tmp_path / "toy"))
    assert hf["model_type"] == TOY_TYPE
    hf_model = build_hf_model(hf, seed=3)
    model = megatron_from_hf(hf, hf_model)
    assert model.hf_config["model_type"] == TOY_TYPE
    tokens_BS = torch.randint(0, hf["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits_BSV = forward_logits(model, tokens_BS)
        want_BSV = hf_model(tokens_BS).logits
    assert logits_BSV.shape == (2, 11, hf["vocab_size"])
    assert (logits_BSV - want_BSV).abs().max().item() <= 1e-5
    qwen = resolve_hf_config("qwen3.5-debug")
    assert prompt_flops(hf, model, 100) == prompt_flops(qwen, model, 100) > 0
    assert response_forward_flops(hf, model, 100, 7) == response_forward_flops(qwen, model, 100, 7) > 0


def test_family_as_a_module_through_the_trainer_flag(tmp_path, monkeypatch, single_process, clean_registry):
    """``--model-family MODULE`` (importable from ``sys.path``) registers the family before
    ``--model`` resolves, so the trainer builds a model of a type the package does not know."""
    from megatron_longstraw.testing.parity import forward_logits
    from megatron_longstraw.training.arguments import parse_args
    from megatron_longstraw.training.setup import build_policy

    (tmp_path / "toy_family_module.py").write_text(_family_source())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "toy_family_module", raising=False)
    args = parse_args(["--model-family", "toy_family_module", "--model", _toy_config(tmp_path / "toy")])
    assert TOY_TYPE not in supported_model_types()  # validating the flag registers nothing
    hf, model, reference, _ = build_policy(args)
    assert family_for(TOY_TYPE).name == "toy"
    assert hf["model_type"] == TOY_TYPE and reference is None
    with torch.no_grad():
        logits_BSV = forward_logits(model, torch.arange(5).unsqueeze(0))
    assert logits_BSV.shape == (1, 5, hf["vocab_size"]) and torch.isfinite(logits_BSV).all()


def test_family_missing_contract_fields_is_refused(tmp_path, clean_registry):
    """A family lacking fields of the ``ModelFamily`` contract is refused with one line naming
    them, by the library function and by the trainer flag; nothing is registered. So is a module
    whose ``FAMILY`` is not a ``ModelFamily``."""
    from megatron_longstraw.training.arguments import parse_args

    path = tmp_path / "partial_family.py"
    path.write_text(_family_source([n for n in _FIELDS if n not in ("prompt_flops", "hf_reference")]))
    with pytest.raises(ValueError) as err:
        use_family(str(path))
    assert str(err.value) == (f"model family file {path}: cannot be imported (ModelFamily.__init__() missing 2 "
                              "required keyword-only arguments: 'hf_reference' and 'prompt_flops')")
    assert TOY_TYPE not in supported_model_types()
    with pytest.raises(ValueError, match=r"^--model-family: model family file .*partial_family.py: cannot be "
                                         r"imported \(ModelFamily.__init__\(\) missing 2") as err:
        parse_args(["--model-family", str(path)])
    assert "\n" not in str(err.value)
    other = tmp_path / "not_a_family.py"
    other.write_text("FAMILY = 'qwen3_5'\n")
    with pytest.raises(ValueError, match=rf"^model family {other}: FAMILY must be a ModelFamily .*, got str$"):
        load_family(str(other))


def test_missing_file_unimportable_module_and_taken_model_type_are_refused(tmp_path, clean_registry):
    missing = tmp_path / "no_such_family.py"
    with pytest.raises(ValueError, match=rf"^model family file {missing}: no such file$"):
        use_family(str(missing))
    with pytest.raises(ValueError, match=r"^model family module no_such_family_module_xyz: cannot be imported "
                                         r"\(No module named 'no_such_family_module_xyz'\)$"):
        use_family("no_such_family_module_xyz")
    path = tmp_path / "clashing_family.py"
    path.write_text(_family_source(model_types=("qwen3_5_text",)))
    with pytest.raises(ValueError, match=r"model family toy: model_type 'qwen3_5_text' already has the family "
                                         r"Qwen3.5$"):
        use_family(str(path))
    assert family_for("qwen3_5_text").name == "Qwen3.5"
    glm = family_for("glm_moe_dsa")
    assert use_family("megatron_longstraw.models.glm5") is glm and register_family(glm) is glm  # built in: no-op
    first = tmp_path / "first" / "family.py"
    first.parent.mkdir()
    first.write_text(_family_source())
    use_family(str(first))
    second = tmp_path / "second" / "family.py"
    second.parent.mkdir()
    second.write_text(_family_source())
    with pytest.raises(ValueError, match=rf"model family toy: model_type '{TOY_TYPE}' already has the family toy$"):
        use_family(str(second))


def test_family_knowledge_comes_from_the_family(single_process):
    """The layout check, the replay FLOPs, the HF output config and the HF reference class are
    the families' own answers."""
    from types import SimpleNamespace

    from megatron_longstraw.testing.hf_reference import hf_model_class
    from megatron_longstraw.testing.parity import seeded_model

    cp2 = SimpleNamespace(context=2)
    for rollouts in ("internal", "jsonl"):  # both families decode under CP: neither refuses it
        family_for("glm_moe_dsa").check_layout(resolve_hf_config("glm-5-debug"), cp2, rollouts)
        family_for("qwen3_5_text").check_layout(resolve_hf_config("qwen3.5-debug"), cp2, rollouts)

    hf = resolve_hf_config("qwen3.5-debug")
    model = seeded_model(hf)
    linear = sum(p.numel() for n, p in model.named_parameters() if n.startswith("decoder.") and p.dim() == 2)
    p, r = 100.0, 30.0
    want = (2 * linear * r + 1 * 2 * 4 * (2 * 16) * r * (p + r / 2)  # 1 attention layer, 4 heads of 16
            + 3 * r * 4 * (6 * 16 * 16 + 2 * 64 * (16 + 16))  # 3 Gated DeltaNet layers, 4 value heads of 16
            + 2 * 64 * 256 * r)  # logits
    assert response_forward_flops(hf, model, 100, 30) == pytest.approx(want, rel=1e-12)
    glm = resolve_hf_config("glm-5-debug")
    assert response_forward_flops(glm, seeded_model(glm), 100, 30) is None

    multimodal = {"model_type": "qwen3_5", "_source": "test", "tie_word_embeddings": True,
                  "architectures": ["Qwen3_5ForConditionalGeneration"], "vision_config": {"depth": 1},
                  "text_config": {k: v for k, v in PRESETS["qwen3.5-debug"].items()
                                  if k not in ("model_type", "tie_word_embeddings")}}
    out = family_for("qwen3_5").hf_output_config(multimodal)
    assert out["model_type"] == "qwen3_5_text" and out["architectures"] == ["Qwen3_5ForCausalLM"]
    assert "vision_config" not in out and "_source" not in out and out["tie_word_embeddings"] is True
    glm_out = family_for("glm_moe_dsa").hf_output_config(glm)
    assert glm_out == {k: v for k, v in glm.items() if k != "_source"}

    assert hf_model_class("qwen3_5_text")[0].__name__ == "Qwen3_5ForCausalLM"
    assert hf_model_class("glm_moe_dsa")[1].__name__ == "GlmMoeDsaConfig"
    with pytest.raises(ValueError, match="model_type 'qwen3_5': the family Qwen3.5 has no HF reference model"):
        hf_model_class("qwen3_5")


def test_converter_takes_a_family_from_outside_the_package(tmp_path, single_process, clean_registry):
    """``tools/convert_checkpoint.py --model-family FILE`` converts a checkpoint of a model_type
    only that family serves (refused without the flag), and the result loads into the model the
    family builds with the HF model's logits."""
    from pathlib import Path

    from megatron_longstraw.checkpointing.model_checkpoint import load_model_checkpoint
    from megatron_longstraw.models.builder import build_model
    from megatron_longstraw.models.options import ModelOptions
    from megatron_longstraw.testing.hf_reference import build_hf_model
    from megatron_longstraw.testing.parity import forward_logits

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import convert_checkpoint

    family = tmp_path / "toy_family.py"
    family.write_text(_family_source())
    hf = dict(PRESETS["qwen3.5-debug"])
    hf_model = build_hf_model(hf, seed=5)
    hf_model.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, model_type=TOY_TYPE)))
    argv = ["hf-to-mcore", "--load", str(tmp_path / "hf"), "--no-progress"]
    assert convert_checkpoint.main(argv + ["--save", str(tmp_path / "refused")]) == 2
    assert not (tmp_path / "refused").exists()
    assert convert_checkpoint.main(argv + ["--save", str(tmp_path / "mcore"), "--model-family", str(family)]) == 0
    model = build_model(dict(hf, model_type=TOY_TYPE), ModelOptions(), parallel_output=False)
    load_model_checkpoint(model, tmp_path / "mcore")
    tokens_BS = torch.randint(0, hf["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (forward_logits(model.eval(), tokens_BS) - hf_model(tokens_BS).logits).abs().max().item() <= 1e-4
