"""YaRN (``models/rope.py``) in both families: logits equal transformers' past the original
maximum position; capture + replay, decoding and the exact sweep equal the full forward there;
``--yarn-factor`` writes the model cards' config (CPU; fp32, the exact sweep fp64)."""

import pytest
import torch

from megatron_longstraw.config.model import ModelConfig
from megatron_longstraw.checkpointing.model_checkpoint import model_hf_config
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.replay import replay_logits
from megatron_longstraw.models.builder import build_model
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.models.rope import with_yarn, yarn_parameters
from megatron_longstraw.testing.hf_reference import build_hf_model
from megatron_longstraw.testing.parity import (assert_exact_equals_full_backprop, forward_logits, megatron_from_hf,
                                               weighted_response_loss)

ORIGINAL, PROMPT, RESPONSE = 24, 70, 20  # every replayed position past the original maximum
QWEN = dict(rope_theta=10_000, partial_rotary_factor=0.5)
GLM = dict(rope_theta=10_000)


def _yarn(preset: str, **rope) -> dict:
    hf = resolve_hf_config(preset)
    base = QWEN if preset.startswith("qwen") else GLM
    hf["rope_parameters"] = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL,
                                 **base, **rope)
    hf["max_position_embeddings"] = 4 * ORIGINAL
    return hf


def _tokens(hf, n, seed):
    return torch.randint(0, hf["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


CASES = [
    ("qwen3.5-debug", {}),
    ("qwen3.5-debug", {"attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2}),
    ("glm-5-debug", {}),
    ("glm-5-debug", {"mscale": 1.0, "mscale_all_dim": 1.0}),  # DeepSeek's: softmax scaled, cos/sin not
    ("glm-5-debug", {"attention_factor": 1.3, "mscale_all_dim": 0.7, "beta_fast": 16}),
]


@pytest.mark.parametrize("preset, rope", CASES[:2])
def test_yarn_parameters_equal_transformers(preset, rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    hf = _yarn(preset, **rope)
    config = Qwen3_5TextConfig(**{k: v for k, v in hf.items() if not k.startswith("_")})
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    inv_freq, factor = yarn_parameters(hf, hf["head_dim"])
    assert torch.equal(inv_freq, want_inv_freq) and factor == want_factor


@pytest.mark.parametrize("preset, rope", CASES)
def test_yarn_logits_equal_transformers_past_the_original_maximum(single_process, preset, rope):
    hf = _yarn(preset, **rope)
    hf_model = build_hf_model(hf, seed=1)
    model = megatron_from_hf(hf, hf_model)
    tokens = _tokens(hf, PROMPT + RESPONSE, 0)
    with torch.no_grad():
        want, got = hf_model(tokens).logits, forward_logits(model, tokens)
        default = dict(hf, rope_parameters=dict(QWEN if preset.startswith("qwen") else GLM, rope_type="default"))
        unscaled = forward_logits(megatron_from_hf(default, build_hf_model(default, seed=1)), tokens)
    assert (got - want)[0, ORIGINAL:].abs().max().item() <= 1e-4
    assert (unscaled - want)[0, ORIGINAL:].abs().max().item() > 1e-3  # (YaRN changed them)


@pytest.mark.parametrize("preset, chunk", [("qwen3.5-debug", 16), ("glm-5-debug", 70)])
def test_yarn_capture_replay_and_decoding_equal_the_full_forward(single_process, preset, chunk):
    from megatron_longstraw.rollout.generate import generate_from_state

    hf = _yarn(preset, **CASES[-1][1]) if preset.startswith("glm") else _yarn(preset)
    model = megatron_from_hf(hf, build_hf_model(hf, seed=1))
    prompt, response = _tokens(hf, PROMPT, 1), _tokens(hf, RESPONSE, 2)
    with torch.no_grad():
        full = forward_logits(model, torch.cat([prompt, response], 1))[0, PROMPT - 1:-1]
        state = capture_prompt(model, prompt, chunk)
        replayed = replay_logits(model, state, response)[:, 0]
    assert (replayed - full).abs().max().item() <= 1e-5
    # decoding from the state: each step's logits are the full forward's at that position
    with torch.no_grad():
        out = generate_from_state(model, state, num_samples=1, max_new_tokens=6, temperature=0.0,
                                  keep_logits=True)
        sequence = torch.cat([prompt, out.responses[0].view(1, -1)], 1)
        want = forward_logits(model, sequence)[0, PROMPT - 1:-1]
    assert (out.step_logits[0] - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
def test_yarn_exact_sweep_equals_full_backprop(single_process, preset):
    """``--prompt-gradient exact`` with YaRN: every parameter's gradient equals full backprop
    through prompt + responses to 1e-9 relative (fp64)."""
    hf = _yarn(preset)
    model = megatron_from_hf(hf, build_hf_model(hf, seed=0).to(torch.float64),
                             ModelOptions(params_dtype=torch.float64))
    prompt = _tokens(hf, PROMPT, 3)
    responses = [_tokens(hf, n, 10 + n)[0] for n in (13, 7)]
    loss_fn = weighted_response_loss(20)
    assert_exact_equals_full_backprop(model, prompt, responses, loss_fn, 16)


def test_yarn_factor_flag_writes_the_model_cards_config():
    hf = model_hf_config(ModelConfig(model="qwen3.6-27b", yarn_factor=4))
    rope = hf["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 262_144)
    assert rope["rope_theta"] == 10_000_000 and rope["partial_rotary_factor"] == 0.25
    assert hf["max_position_embeddings"] == 1_048_576
    assert with_yarn(hf, 4) is hf  # a checkpoint saved with the flag: kept as is
    with pytest.raises(ValueError, match=r"--yarn-factor 8: .* already has YaRN with factor 4.0"):
        with_yarn(hf, 8)
    # --max-position-embeddings still sets the budget
    assert model_hf_config(ModelConfig(model="qwen3.6-27b", yarn_factor=4,
                                       max_position_embeddings=1_010_000))["max_position_embeddings"] == 1_010_000
    with pytest.raises(ValueError, match="--yarn-factor must be > 1, got 0.5"):
        ModelConfig(yarn_factor=0.5)


def test_unknown_rope_type_is_one_line_naming_the_field(single_process):
    for preset, family in (("qwen3.5-debug", "Qwen3.5"), ("qwen3.5-moe-debug", "Qwen3.5-MoE"),
                           ("glm-5-debug", "GLM-5")):
        hf = resolve_hf_config(preset)
        hf["rope_parameters"] = dict(hf["rope_parameters"], rope_type="longrope")
        with pytest.raises(ValueError, match=rf"rope_parameters.rope_type 'longrope' is not supported for {family} "
                                             r"\(default, yarn\)"):
            build_model(hf, ModelOptions())
    yarn = _yarn("qwen3.5-debug")
    del yarn["rope_parameters"]["original_max_position_embeddings"]
    with pytest.raises(ValueError, match="rope_parameters.original_max_position_embeddings is required"):
        build_model(yarn, ModelOptions())
    with pytest.raises(ValueError, match="rope_parameters.truncate=false is not supported"):
        build_model(_yarn("glm-5-debug", truncate=False), ModelOptions())
