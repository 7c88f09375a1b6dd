"""The prompt state holds exactly the listed tensors; bad input to capture/replay is refused."""

import pytest
import torch

from megatron_longstraw.attention.sdpa_core import AttentionKVState
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.replay import replay_logits
from megatron_longstraw.models.builder import build_model
from megatron_longstraw.models.gated_delta_net import GatedDeltaState
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config


def _qwen_state_bytes(hf: dict, prompt: int, dtype_bytes: int) -> int:
    """From the HF config alone: K/V pages of attention layers, fp32 recurrent state plus the
    (kernel - 1)-input conv tail of Gated DeltaNet layers, and the last hidden state."""
    total = hf["hidden_size"] * dtype_bytes
    for kind in hf["layer_types"]:
        if kind == "full_attention":
            total += 2 * prompt * hf["num_key_value_heads"] * hf["head_dim"] * dtype_bytes
        else:
            total += hf["linear_num_value_heads"] * hf["linear_key_head_dim"] * hf["linear_value_head_dim"] * 4
            conv_channels = (2 * hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
                             + hf["linear_num_value_heads"] * hf["linear_value_head_dim"])
            total += conv_channels * (hf["linear_conv_kernel_dim"] - 1) * dtype_bytes
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_state_holds_exactly_the_listed_tensors(single_process, dtype):
    hf = resolve_hf_config("qwen3.5-debug")
    model = build_model(hf, ModelOptions(params_dtype=dtype))
    prompt = torch.randint(0, hf["vocab_size"], (1, 37))
    state = capture_prompt(model, prompt, 10)
    kinds = [type(s) for s in state.layers.values()]
    assert kinds.count(AttentionKVState) == hf["layer_types"].count("full_attention")
    assert kinds.count(GatedDeltaState) == hf["layer_types"].count("linear_attention")
    for layer in state.layers.values():
        if isinstance(layer, GatedDeltaState):
            assert layer.recurrent_BHKV.dtype == torch.float32
    assert state.nbytes() == _qwen_state_bytes(hf, 37, dtype.itemsize)
    state.free()
    assert state.nbytes() == 0


def test_empty_prompt_is_refused(single_process):
    model = build_model(resolve_hf_config("qwen3.5-debug"))
    with pytest.raises(ValueError, match="at least one token"):
        capture_prompt(model, torch.zeros(1, 0, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="--prompt-chunk-size must be >= 1"):
        capture_prompt(model, torch.zeros(1, 4, dtype=torch.long), 0)


def test_response_beyond_position_budget_is_refused(single_process):
    hf = resolve_hf_config("qwen3.5-debug")
    hf["max_position_embeddings"] = 64
    model = build_model(hf)
    state = capture_prompt(model, torch.zeros(1, 60, dtype=torch.long), 16)
    with pytest.raises(ValueError, match="response of 5 tokens after a 60-token prompt exceeds the model's 64 positions"):
        replay_logits(model, state, torch.zeros(1, 5, dtype=torch.long))


def test_state_from_another_model_is_refused(single_process):
    hf = resolve_hf_config("qwen3.5-debug")
    model = build_model(hf)
    other_hf = dict(hf, intermediate_size=96)
    other = build_model(other_hf)
    state = capture_prompt(other, torch.zeros(1, 8, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="prompt state was captured with a different model"):
        replay_logits(model, state, torch.zeros(1, 3, dtype=torch.long))
