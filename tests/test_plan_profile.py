"""The families' ``plan_profile`` against the real code: parameters of the built model, the FLOPs
of ``prompt_flops``, the prompt state a capture keeps and its gradient buffers, the bytes autograd
saves in a replay and a swept chunk (on CPU), and the H200 activation measurements of
``docs/bench/`` (within 3 %)."""

import collections
import contextlib
import json
import re
from pathlib import Path

import pytest
import torch

from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.longstraw.activation_meter import SavedTensorMeter
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.cost_model import prompt_flops
from megatron_longstraw.longstraw.prompt_backward import prompt_backward
from megatron_longstraw.longstraw.replay import replay_responses
from megatron_longstraw.models.builder import build_stage_model
from megatron_longstraw.models.flops import active_linear_weight_elements
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config, with_num_layers
from megatron_longstraw.models.registry import family_for

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"
GiB = 2 ** 30


def _config(preset: str, layers: int | None = None, **changes) -> dict:
    hf = resolve_hf_config(preset)
    hf = with_num_layers(hf, layers) if layers else hf
    hf.update(changes)
    return hf


def _profile(hf: dict):
    return family_for(hf["model_type"]).plan_profile(hf)


def _build(hf: dict, dtype=torch.float32, initialize: bool = True, meta: bool = False, **options):
    """The model the project builds; ``initialize=False`` (no weight init) keeps realistic widths
    instant, ``meta`` puts the parameters on the meta device (no memory): the parameter set and
    shapes are the same."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        return build_stage_model(hf, ModelOptions(params_dtype=dtype, perform_initialization=initialize, **options))


def _tokens(hf: dict, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, hf["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _loss(logprobs_RB, mask_RB, indices):
    return -(logprobs_RB * mask_RB).sum()  # the benchmark's loss (up to its constant scale)


# ----------------------------------------------------------------------------- parameters

PARAM_CONFIGS = {
    "qwen3.5-debug": lambda: _config("qwen3.5-debug"),
    "qwen3.5-debug-qkv-bias-one-group": lambda: _config("qwen3.5-debug", attention_bias=True, num_key_value_heads=1),
    "qwen3.5-0.8b": lambda: _config("qwen3.5-0.8b"),               # tied embeddings, 24 layers
    "qwen3.6-27b-4-layers": lambda: _config("qwen3.6-27b", 4),      # GVA (48 value heads over 16), untied
    "glm-5-debug": lambda: _config("glm-5-debug"),                 # a shared-indexer layer, grouped routing
    "glm-5-debug-no-shared-expert": lambda: _config("glm-5-debug", n_shared_experts=0),
    "glm-5-mini": lambda: _config("glm-5-mini"),
    "glm-5-4-layers": lambda: _config("glm-5", 4),                 # 256 experts: on the meta device
}


def _built_counts(model) -> tuple[dict, collections.Counter]:
    """Per decoder layer ``{params, experts, replicated}`` and the other parameters by name.
    Replicated: what Megatron does not mark ``tensor_model_parallel`` (kept whole on every TP rank)."""
    layers = collections.defaultdict(collections.Counter)
    other = collections.Counter()
    for name, param in model.named_parameters():
        match = re.match(r"decoder\.layers\.(\d+)\.", name)
        if match is None:
            other[name] += param.numel()
            continue
        counts = layers[int(match.group(1))]
        counts["params"] += param.numel()
        counts["experts"] += param.numel() if ".mlp.experts." in name else 0
        counts["replicated"] += 0 if getattr(param, "tensor_model_parallel", False) else param.numel()
    return layers, other


@pytest.mark.parametrize("config", PARAM_CONFIGS)
def test_parameters_equal_the_built_model(single_process, config):
    """Every count of the profile equals the built model's, layer by layer: all parameters, the
    routed experts', the TP-replicated ones, the embedding, output layer (none when tied) and
    final norm; the active linear weights equal the FLOPs helper's count on the model."""
    hf = PARAM_CONFIGS[config]()
    profile = _profile(hf)
    model = _build(hf, initialize=config.endswith("debug"), meta=config == "glm-5-4-layers")
    layers, other = _built_counts(model)
    assert len(profile.layers) == len(layers) == hf["num_hidden_layers"]
    for index, layer in enumerate(profile.layers):
        built = layers[index]
        assert (layer.params, layer.expert_params, layer.replicated_params) == (
            built["params"], built["experts"], built["replicated"]), f"layer {index} ({layer.mixer})"
    assert profile.embedding_params == other.pop("embedding.word_embeddings.weight")
    assert profile.output_params == other.pop("output_layer.weight", 0)
    assert profile.final_norm_params == other.pop("decoder.final_layernorm.weight")
    assert not other, f"parameters the profile does not know: {sorted(other)}"
    assert profile.params == sum(p.numel() for p in model.parameters())
    experts_per_token = hf.get("num_experts_per_tok", 1)  # Qwen: no routed experts, every linear counts
    assert sum(layer.active_linear_params for layer in profile.layers) == active_linear_weight_elements(
        model, experts_per_token)
    assert profile.num_experts == hf.get("n_routed_experts", 0)


def test_profile_names_the_preset_or_the_model_type_and_refuses_a_bad_config(tmp_path):
    """A preset's profile carries its name, a config folder's its model_type; an invalid config is
    the family's one-line ``ValueError``, as ``normalize_hf_config`` gives it."""
    assert _profile(_config("glm-5-mini")).name == "glm-5-mini"
    hf = _config("qwen3.5-debug")
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if not k.startswith("_")}))
    assert _profile(resolve_hf_config(str(tmp_path))).name == "qwen3_5_text"
    with pytest.raises(ValueError, match="layer_types must list 4 entries"):
        _profile(dict(hf, layer_types=["full_attention"] * 3))
    with pytest.raises(ValueError, match="missing field 'n_routed_experts'"):
        _profile({k: v for k, v in _config("glm-5-debug").items() if k != "n_routed_experts"})


# ----------------------------------------------------------------------------- FLOPs

def _capture_flops(profile, length: int) -> float:
    """Forward FLOPs of capturing a ``length`` prompt composed from the profile: every layer's
    active linear weights (2 per weight and token), dense causal attention over ``length^2 / 2``
    pairs, sparse attention over ``min(topk, position + 1)`` keys per query, the DSA indexer over
    every visible pair (``length (length + 1) / 2``), the delta rule per token, the last position's
    logits."""
    p = float(length)
    flops = 2.0 * profile.hidden_size * profile.vocab_size
    for layer in profile.layers:
        flops += 2.0 * layer.active_linear_params * p + layer.delta_rule_flops_per_token * p
        if layer.sparse_topk:
            k = min(float(layer.sparse_topk), p)
            flops += layer.attention_pair_flops * (k * p - k * (k - 1) / 2)
            flops += layer.indexer_pair_flops * p * (p + 1) / 2
        else:
            flops += layer.attention_pair_flops * p * p / 2
    return flops


@pytest.mark.parametrize("config", ["qwen3.5-debug", "qwen3.5-0.8b", "glm-5-debug", "glm-5-mini"])
def test_flops_from_the_profile_equal_prompt_flops(single_process, config):
    """The profile's linear, attention, indexer and delta-rule terms give the family's own
    ``prompt_flops`` on the built model, at lengths below and above DSA's top-k."""
    hf = PARAM_CONFIGS[config]()
    profile = _profile(hf)
    model = _build(hf, initialize=config.endswith("debug"))
    for length in (1, 5, 100, 3000, 1 << 20):
        want = prompt_flops(hf, model, length)
        assert _capture_flops(profile, length) == pytest.approx(want, rel=1e-9), length
    # the terms are there at all (a zero would hide in a sum dominated by another)
    assert all(layer.attention_pair_flops > 0 or layer.delta_rule_flops_per_token > 0 for layer in profile.layers)


# ----------------------------------------------------------------------------- prompt state

def _expected_state_bytes(profile, prompt: int, chunks: int, exact: bool, dtype) -> int:
    """``PromptState.nbytes`` from the profile. bf16: as profiled; fp32: what follows the
    parameters' dtype doubles and the recurrent state stays fp32, so every state element is 4
    bytes (``grad_state_elements_fixed`` counts every fixed element, and every per-token element
    is in the parameters' dtype)."""
    total = 0
    for layer in profile.layers:
        per_token, fixed = layer.state_bytes_per_token, layer.state_bytes_fixed
        if dtype == torch.float32:
            per_token, fixed = 2 * per_token, 4 * layer.grad_state_elements_fixed
        total += per_token * prompt + fixed * (1 + chunks if exact else 1)  # exact: a copy per chunk start
    last_hidden = profile.last_hidden_state_bytes * (2 if dtype == torch.float32 else 1)
    return total + last_hidden


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("exact, prompt, chunk", [(False, 30, 7), (True, 30, 7), (True, 29, 29)])
def test_state_bytes_equal_a_captured_prompt(single_process, preset, dtype, exact, prompt, chunk):
    """``PromptState.nbytes`` after a capture equals the profile's state: per-token pages, the
    fixed recurrent state and conv tail (in exact mode once more per capture chunk), the last
    hidden state."""
    hf = _config(preset)
    model = _build(hf, dtype)
    state = capture_prompt(model, _tokens(hf, prompt, 3), chunk, exact=exact)
    chunks = -(-prompt // chunk)
    assert state.nbytes() == _expected_state_bytes(_profile(hf), prompt, chunks, exact, dtype)


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
def test_state_gradient_elements_equal_the_exact_buffers(single_process, preset):
    """After an exact replay, ``state_grad_nbytes`` is 4 bytes per profiled gradient element: the
    K/V pages or MLA latents per token (not DSA's indexer keys), the recurrent state and conv tail,
    the last hidden state."""
    hf, prompt = _config(preset), 30
    model = _build(hf, torch.bfloat16)
    state = capture_prompt(model, _tokens(hf, prompt, 3), 10, exact=True)
    replay_responses(model, state, [_tokens(hf, 9, 4)[0]], _loss, exact=True)
    profile = _profile(hf)
    elements = sum(layer.grad_state_elements_per_token * prompt + layer.grad_state_elements_fixed
                   for layer in profile.layers) + profile.last_hidden_grad_elements
    assert state.state_grad_nbytes() == 4 * elements


# ----------------------------------------------------------------------------- activations

def _replay_bytes_per_token(profile, layers=None, last_stage: bool = True) -> float:
    layers = profile.layers if layers is None else layers
    return (sum(layer.replay_activation_bytes_per_token for layer in layers)
            + (profile.logits_bytes_per_token if last_stage else 0.0))


def _sweep_bytes_per_token(profile) -> float:
    return (sum(layer.sweep_activation_bytes_per_token for layer in profile.layers)
            + profile.sweep_final_norm_bytes_per_token)


def _metered(hf: dict, model, prompt: int, chunk: int, response: int) -> tuple[int, int, int]:
    """``(replay bytes, sweep bytes, swept chunk tokens)``: the benchmark's meter (parameters and
    prompt state excluded) around one exact replay of one response and around the last chunk's
    recompute in the reverse sweep (``tools/bench_longstraw.py``)."""
    prompt_ids = _tokens(hf, prompt, 3)
    state = capture_prompt(model, prompt_ids, chunk, exact=True)
    kept = [*model.parameters(), *(t for s in state.layers.values() for t in s.tensors().values()),
            state.last_hidden_1BH]
    with SavedTensorMeter(kept) as replay:
        replay_responses(model, state, [_tokens(hf, response, 4)[0]], _loss, exact=True)
    sweep, last = SavedTensorMeter(kept), len(state.chunk_starts) - 1
    prompt_backward(model, state, prompt_ids, chunk_context=lambda i: sweep if i == last else contextlib.nullcontext())
    return replay.nbytes, sweep.nbytes, prompt - state.chunk_starts[-1]


@pytest.fixture
def compiled_output_gate(monkeypatch):
    """Megatron's attention output gate compiled as on the GPU (there ``jit_fuser`` is
    ``torch.compile``; on CPU ``patches.no_compile`` runs it eagerly, keeping the fp32 sigmoid
    instead of the gate's bf16 input): Inductor's partitioner on CPU (``aot_eager_decomp_partition``,
    no C++ build), dynamo on for this test only."""
    import torch._dynamo
    from megatron.core.transformer.attention import Attention

    monkeypatch.setattr(Attention, "_apply_output_gate",
                        torch.compile(Attention._apply_output_gate, backend="aot_eager_decomp_partition"))
    with torch._dynamo.config.patch(disable=False):  # (monkeypatch would delete the config entry)
        yield
    torch._dynamo.reset()


def test_attention_activation_bytes_equal_a_metered_replay_and_sweep(single_process, compiled_output_gate):
    """Qwen3.5's full-attention layers (a debug model with no Gated DeltaNet, whose CPU kernels
    save other tensors than fla's): the bytes the meter counts in a replay and a swept chunk,
    through the fused attention path's emulation (the same autograd Function as cuDNN's), are
    the profile's within 1 % (what remains: per-call constants, the norms' fp32 weights)."""
    hf = _config("qwen3.5-debug", layer_types=["full_attention"] * 4)
    model = _build(hf, torch.bfloat16, kernel_options=KernelOptions(attention_backend="emulated"))
    profile = _profile(hf)
    replay, sweep, swept = _metered(hf, model, prompt=64, chunk=32, response=256)
    assert replay == pytest.approx(256 * _replay_bytes_per_token(profile), rel=0.01)
    assert sweep == pytest.approx(swept * _sweep_bytes_per_token(profile), rel=0.01)


def test_glm5_activation_bytes_equal_a_metered_replay_and_sweep(single_process):
    """GLM-5 runs the same torch code on CPU and GPU with gradients (MLA, the checkpointed sparse
    blocks, the router and experts): a replay's and a swept chunk's metered bytes on the debug
    model are the profile's within 2 % (per-call constants; the meter keys storages by address,
    so one freed and reallocated there counts once)."""
    hf = _config("glm-5-debug")
    model = _build(hf, torch.bfloat16)
    profile = _profile(hf)
    replay, sweep, swept = _metered(hf, model, prompt=512, chunk=256, response=512)
    assert replay == pytest.approx(512 * _replay_bytes_per_token(profile), rel=0.02)
    assert sweep == pytest.approx(swept * _sweep_bytes_per_token(profile), rel=0.02)


def _bench(name: str, key: str, **where) -> float:
    """A recorded figure of ``docs/bench/bench_{name}.json``: ``key`` of its first result matching ``where``."""
    results = json.loads((BENCH / f"bench_{name}.json").read_text())["results"]
    return next(r[key] for r in results if r.get(key) is not None and all(r.get(k) == v for k, v in where.items()))


# name -> (measured GiB, preset, --num-layers, tokens, what was metered). The H200 measurements (bf16, local spec, cuDNN SDPA,
# fla, the meter of tools/bench_longstraw.py around one replayed micro-batch or one recomputed
# chunk); the profile matches each within 1e-3 (1e-4 for the replays).
H200 = {
    # one 8,192-token response: 19.754 GiB, any prompt length, CP=1 and CP=2 alike
    "qwen3.5-0.8b-replay": (lambda: _bench("qwen3.5-0.8b", "activation_gib", prompt_length=524288, group=8),
                            "qwen3.5-0.8b", None, 8192, "replay"),
    "qwen3.5-0.8b-cp2-replay": (lambda: _bench("qwen3.5-0.8b_cp2", "activation_gib", context_parallel=2),
                                "qwen3.5-0.8b", None, 8192, "replay-cp"),
    # PP=2, stage 0 (layers 0-11 and the embedding; the measured rank): 9.838 GiB
    "qwen3.5-0.8b-pp2-stage0-replay": (lambda: _bench("qwen3.5-0.8b_pp2-512k", "activation_gib"),
                                       "qwen3.5-0.8b", None, 8192, "stage0"),
    # exact mode, the last 32,768-token chunk's recompute: 78.975 GiB at 1M, 78.971 GiB at 512K
    "qwen3.5-0.8b-sweep-32k-1m": (lambda: _bench("qwen3.5-0.8b_exact_1m", "sweep_activation_gib"),
                                  "qwen3.5-0.8b", None, 32768, "sweep"),
    "qwen3.5-0.8b-sweep-32k-512k": (lambda: _bench("qwen3.5-0.8b_exact_512k", "sweep_activation_gib"),
                                    "qwen3.5-0.8b", None, 32768, "sweep"),
    # 16,384-token chunks: 39.503 GiB at 1.25M, 39.495 GiB at 256K
    "qwen3.5-0.8b-sweep-16k-1.25m": (lambda: _bench("qwen3.5-0.8b_exact_1.25m_g8", "sweep_activation_gib"),
                                     "qwen3.5-0.8b", None, 16384, "sweep"),
    "qwen3.5-0.8b-sweep-16k-256k": (lambda: _bench("qwen3.5-0.8b_exact_256k_two_points", "sweep_activation_gib"),
                                    "qwen3.5-0.8b", None, 16384, "sweep"),
    # --num-layers 4 (3 Gated DeltaNet + 1 attention, hidden 5120, ffn 17408): 12.714 GiB per 8,192 tokens
    "qwen3.6-27b-4-layers-replay": (lambda: _bench("qwen3.6-27b_27b-4l-2m", "activation_gib"),
                                    "qwen3.6-27b", 4, 8192, "replay"),
    # one 4,096-token response, CP=1: 11.820 GiB
    "glm-5-mini-replay": (lambda: _bench("glm-5-mini_128k", "activation_gib"), "glm-5-mini", None, 4096, "replay"),
    # the same under CP=2 (each rank replays the whole response; merging over the pages' ranks): 17.84 GiB
    "glm-5-mini-cp2-replay": (lambda: _bench("glm-5-mini_cp2-1m", "activation_gib", context_parallel=2),
                              "glm-5-mini", None, 4096, "replay-cp"),
    # exact mode, the 4,096-token warm-up chunk's recompute of bench_glm-5-mini_exact_512k_32k-chunks
    # (its JSON holds the main point, whose sweep ran out of memory; docs/exact_prompt_gradient.md)
    "glm-5-mini-sweep-4k": (lambda: 11.805, "glm-5-mini", None, 4096, "sweep"),
}


@pytest.mark.parametrize("figure", H200)
def test_activation_bytes_match_the_h200_measurements(figure):
    """Each recorded H200 figure against the profile's bytes per token times the tokens, within
    3 %: a replay counts every layer and what follows the last one (final norm, the logits'
    checkpointed input, the loss's per-token factor), under CP each layer's merge too (Qwen3.5:
    none, its CP=2 figure is its CP=1 one), PP stage 0 its own 12 layers only, a swept chunk every
    layer and the final norm."""
    measured, preset, layers, tokens, kind = H200[figure]
    profile = _profile(_config(preset, layers))
    if kind == "replay":
        per_token = _replay_bytes_per_token(profile)
    elif kind == "replay-cp":
        per_token = _replay_bytes_per_token(profile) + sum(x.replay_cp_extra_bytes_per_token for x in profile.layers)
    elif kind == "stage0":
        per_token = _replay_bytes_per_token(profile, profile.layers[:len(profile.layers) // 2], last_stage=False)
    else:
        per_token = _sweep_bytes_per_token(profile)
    assert per_token * tokens / GiB == pytest.approx(measured(), rel=1e-3)
