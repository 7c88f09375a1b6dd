"""Qwen3.5 family: logits and weight mapping against HF transformers' reference model (fp32, CPU)."""

import copy

import pytest
import torch

from megatron_longstraw.models.qwen3_5 import FAMILY as QWEN3_5
from megatron_longstraw.models.builder import build_model, load_full_state_dict
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.qwen3_5.presets import PRESETS
from megatron_longstraw.testing.hf_reference import build_hf_model


def _debug_config(**overrides) -> dict:
    hf = copy.deepcopy(PRESETS["qwen3.5-debug"])
    hf.update(overrides)
    return hf


def _megatron_from_hf(hf, hf_model):
    model = build_model(hf, ModelOptions(), parallel_output=False)
    load_full_state_dict(model, QWEN3_5.weights.hf_to_mcore(hf_model.state_dict(), hf))
    return model.eval()


def _logits(model, tokens):
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(tokens, position_ids, attention_mask=None)


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_hf(single_process, tie):
    """All layer types, GQA groups > 1 (attention and GDN), 70 tokens (> one 64-token GDN chunk)."""
    hf = _debug_config(tie_word_embeddings=tie)
    assert {"linear_attention", "full_attention"} <= set(hf["layer_types"])
    assert hf["num_attention_heads"] > hf["num_key_value_heads"]
    assert hf["linear_num_value_heads"] > hf["linear_num_key_heads"]
    hf_model = build_hf_model(hf, seed=1)
    model = _megatron_from_hf(hf, hf_model)
    tokens = torch.randint(0, hf["vocab_size"], (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        actual = _logits(model, tokens)
    assert actual.shape == expected.shape
    diff = (actual - expected).abs().max().item()
    assert diff <= 1e-4, f"max abs logit diff {diff}"
    assert expected.abs().max().item() > 1e-2  # the comparison is not between near-zero logits


def test_weight_mapping_round_trip_is_bit_identical():
    hf = _debug_config()
    hf_state = build_hf_model(hf, seed=2).state_dict()
    back = QWEN3_5.weights.mcore_to_hf(QWEN3_5.weights.hf_to_mcore(hf_state, hf), hf)
    assert sorted(back) == sorted(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(back[name], tensor), name


def test_forward_backward_reaches_every_parameter(single_process):
    hf = _debug_config()
    model = build_model(hf, ModelOptions())
    tokens = torch.randint(0, hf["vocab_size"], (1, 33))
    logits = _logits(model, tokens)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:])
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"zero gradient for {name}"


def test_full_activation_recompute_gives_identical_gradients(single_process):
    hf = _debug_config()
    hf_model = build_hf_model(hf, seed=4)
    tokens = torch.randint(0, hf["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    grads = []
    for recompute in (None, "full"):
        model = build_model(hf, ModelOptions(recompute_granularity=recompute), parallel_output=False)
        load_full_state_dict(model, QWEN3_5.weights.hf_to_mcore(hf_model.state_dict(), hf))
        model.train()
        logits = _logits(model, tokens)
        torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7), name
