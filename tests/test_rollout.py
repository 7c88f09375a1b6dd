"""Rollouts from a captured prompt state: decoding against the full forward, sharing, sampling, EOS, TP."""

import pytest
import torch

from megatron_longstraw.attention import sdpa_core
from megatron_longstraw.attention.decode_attention import decode_attention
from megatron_longstraw.attention.prefix_attention import prefix_causal_attention_math
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.core.decode_state import new_decode_state
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.decode_step import decode_step
from megatron_longstraw.longstraw.model_steps import token_logprobs
from megatron_longstraw.longstraw.replay import replay_logits
from megatron_longstraw.models.glm5 import layers as glm5_layers
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.rollout.generate import generate_from_state
from megatron_longstraw.rollout.sampling import (
    check_sampling, sample_tokens, sampling_logprobs, sampling_probs, scale_logits, top_p_filter)
from megatron_longstraw.testing.hf_reference import build_hf_model
from megatron_longstraw.testing.multiprocess import run_multiprocess
from megatron_longstraw.testing.parity import forward_logits, megatron_from_hf
from megatron_longstraw.testing.rollout_parity import rollouts, sharded_output_model, tp_rollout_worker

PROMPT, CHUNK, NEW, SAMPLES = 45, 16, 8, 3  # the chunk does not divide the prompt
PRESETS = ["qwen3.5-debug", "glm-5-debug"]


# the blocked prompt parts exercised: 7 prompt keys per attention / indexer block
SMALL_BLOCKS = KernelOptions(prefix_block=7, dsa_key_block=7)


def _model(preset, seed=0, kernels=KernelOptions()):
    hf = resolve_hf_config(preset)
    return hf, megatron_from_hf(hf, build_hf_model(hf, seed=seed),
                                ModelOptions(params_dtype=torch.float32, kernel_options=kernels))


def _prompt(hf, n=PROMPT, seed=1):
    return torch.randint(0, hf["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _full_logits(model, prompt_1S, response_R):
    """Full-forward logits ``[r, vocab]`` predicting each response token."""
    ids = torch.cat([prompt_1S, response_R[None]], dim=1)
    return forward_logits(model, ids)[0, prompt_1S.shape[1] - 1:-1]


# ----------------------------------------------------------------------------- against the full forward


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_decode_logits_equal_full_forward_and_replay(single_process, preset, temperature):
    """Each sample's logits at every step equal a full forward of prompt + its own tokens so far;
    greedy tokens are the full forward's argmax; sampled samples differ from one another, and
    replaying each against the same prompt state gives the log-probs decoding reported."""
    hf, model = _model(preset, kernels=SMALL_BLOCKS)
    prompt = _prompt(hf)
    with torch.no_grad():
        state = capture_prompt(model, prompt, CHUNK)
        result = generate_from_state(model, state, SAMPLES, NEW, temperature=temperature,
                                     generator=torch.Generator().manual_seed(7), keep_logits=True)
        fulls = [_full_logits(model, prompt, r) for r in result.responses]
        replayed = [token_logprobs(replay_logits(model, state, r[None]), r[:, None])[:, 0]
                    for r in result.responses]
    assert [r.numel() for r in result.responses] == [NEW] * SAMPLES
    assert result.decode_steps == NEW - 1 and result.seconds > 0
    for response, logits, full in zip(result.responses, result.step_logits, fulls):
        diff = (logits - full).abs().max().item()
        assert diff <= 1e-5, f"max abs logit diff {diff}"
        if temperature == 0:
            assert torch.equal(response, full.argmax(-1))
    for sample in range(SAMPLES):
        assert (replayed[sample] - result.logprobs[sample]).abs().max().item() <= 1e-5
        # at temperature 1 and top-p 1 the sampling distribution is the model's
        want = result.logprobs[sample] if temperature else torch.zeros(NEW)
        assert torch.allclose(result.sampling_logprobs[sample], want, atol=1e-6)
    if temperature > 0:
        assert len({tuple(r.tolist()) for r in result.responses}) == SAMPLES


@pytest.mark.parametrize("preset", PRESETS)
def test_multi_token_steps_equal_full_forward(single_process, preset):
    """Decode steps of several tokens per sample (bottom-right causal over the sample's own keys)."""
    hf, model = _model(preset)
    prompt = _prompt(hf)
    tokens = torch.randint(0, hf["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        state = capture_prompt(model, prompt, CHUNK)
        decode = new_decode_state(model, state, num_samples=2, capacity=6)
        first = decode_step(model, decode, tokens[:, :2])
        last = decode_step(model, decode, tokens[:, 2:])
        for sample in range(2):
            full = forward_logits(model, torch.cat([prompt, tokens[sample:sample + 1]], 1))[0]
            assert (first[sample] - full[PROMPT + 1]).abs().max() <= 1e-5
            assert (last[sample] - full[-1]).abs().max() <= 1e-5
        with pytest.raises(ValueError, match="capacity 6 cannot take 1 more tokens after 6"):
            decode_step(model, decode, tokens[:, :1])


def _dsa_topk_holder(model):
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    return getattr(model.config, DSAttention._HOLDER_ATTR)


def test_glm_decode_top_k_is_the_full_forwards(single_process):
    """Each decoded token's DSA selection over [prompt keys; generated keys] is the full forward's
    (set equality), and later tokens select generated keys as well as prompt keys."""
    hf, model = _model("glm-5-debug", kernels=SMALL_BLOCKS)
    prompt = _prompt(hf)
    tokens = torch.randint(0, hf["vocab_size"], (1, NEW), generator=torch.Generator().manual_seed(4))
    full_layers = [i + 1 for i, t in enumerate(hf["indexer_types"]) if t == "full"]
    mixed = 0
    with torch.no_grad():
        forward_logits(model, torch.cat([prompt, tokens], 1))
        full_topk = {layer: t[0].clone() for layer, t in _dsa_topk_holder(model).items()}
        decode = new_decode_state(model, capture_prompt(model, prompt, CHUNK), 1, NEW)
        for step in range(NEW):
            decode_step(model, decode, tokens[:, step:step + 1])
            assert sorted(_dsa_topk_holder(model)) == full_layers
            for layer in full_layers:
                got = _dsa_topk_holder(model)[layer][0, 0]
                want = full_topk[layer][PROMPT + step]
                assert torch.equal(got.sort().values, want[want >= 0].sort().values), (step, layer)
                mixed += bool((got < PROMPT).any() and (got >= PROMPT).any())
    assert mixed >= NEW  # most steps mix prompt and generated keys


# ----------------------------------------------------------------------------- sharing, memory


def _expected_decode_bytes(hf, preset, samples, capacity):
    """Per-sample bytes only (fp32): generated tokens' K/V / latents / indexer keys, GDN state copies."""
    e = 4
    if preset == "glm-5-debug":
        full_indexers = sum(t == "full" for t in hf["indexer_types"])
        per_token = (hf["num_hidden_layers"] * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"])
                     + full_indexers * hf["index_head_dim"])
        return capacity * samples * per_token * e
    total = 0
    for kind in hf["layer_types"]:
        if kind == "full_attention":
            total += 2 * capacity * samples * hf["num_key_value_heads"] * hf["head_dim"] * e
        else:
            conv_channels = (2 * hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
                             + hf["linear_num_value_heads"] * hf["linear_value_head_dim"])
            total += samples * (hf["linear_num_value_heads"] * hf["linear_key_head_dim"]
                                * hf["linear_value_head_dim"] * 4
                                + conv_channels * (hf["linear_conv_kernel_dim"] - 1) * e)
    return total


def _spy(monkeypatch, module, name, prompt_arg, seen):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        seen.append(args[prompt_arg].data_ptr())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


@pytest.mark.parametrize("preset", PRESETS)
def test_prompt_state_is_shared_not_copied(single_process, monkeypatch, preset):
    """Every decode call reads the captured prompt tensors in place (same storage); the decode's own
    memory is the per-sample part by formula; the prompt state is left unchanged."""
    hf, model = _model(preset)
    seen = []
    _spy(monkeypatch, sdpa_core, "decode_attention", 3, seen)          # prompt K (V is its twin)
    _spy(monkeypatch, glm5_layers, "decode_index_topk", 2, seen)       # prompt indexer keys
    _spy(monkeypatch, glm5_layers, "decode_sparse_attention", 1, seen)  # prompt latents
    with torch.no_grad():
        state = capture_prompt(model, _prompt(hf), CHUNK)
        before = {(n, f): t.clone() for n, s in state.layers.items() for f, t in s.tensors().items()}
        nbytes = state.nbytes()
        result = generate_from_state(model, state, SAMPLES, NEW, temperature=1.0,
                                     generator=torch.Generator().manual_seed(2))
    shared = {s.tensors()[f].data_ptr() for s in state.layers.values()
              for f in ("key_SBGD", "latent_SBD", "key_SBD") if f in s.tensors()}
    # one read per step of each prompt K / latent / indexer-key tensor (shared-indexer layers
    # select no keys of their own)
    assert len(seen) == len(shared) * (NEW - 1)
    assert set(seen) == shared
    assert result.decode_state_bytes == _expected_decode_bytes(hf, preset, SAMPLES, NEW - 1)
    assert state.nbytes() == nbytes
    for (name, field), tensor in before.items():
        assert torch.equal(state.layers[name].tensors()[field], tensor), (name, field)


# ----------------------------------------------------------------------------- EOS, progress


def test_eos_stops_its_sample_only(single_process):
    """EOS = sample 0's sampled token at some step k: sample 0 ends there with EOS included; the
    others are unchanged up to k and go on."""
    hf, model = _model("qwen3.5-debug")
    with torch.no_grad():
        state = capture_prompt(model, _prompt(hf), CHUNK)
        run = lambda eos: generate_from_state(model, state, SAMPLES, NEW, temperature=1.0, top_p=0.95,
                                              eos_id=eos, generator=torch.Generator().manual_seed(11))
        free = run(None)
        tokens = torch.stack(free.responses)  # [samples, NEW]
        step = next(k for k in range(2, NEW - 2) if not (tokens[:, : k + 1] == tokens[0, k]).sum() > 1)
        eos = tokens[0, step].item()
        stopped = run(eos)
    assert stopped.responses[0].tolist() == tokens[0, : step + 1].tolist()
    assert stopped.stopped_by_eos[0] and stopped.responses[0][-1].item() == eos
    assert stopped.logprobs[0].numel() == step + 1
    for sample in range(1, SAMPLES):
        response = stopped.responses[sample]
        assert response[: step + 1].tolist() == tokens[sample, : step + 1].tolist()
        assert response.numel() == NEW or (stopped.stopped_by_eos[sample] and response[-1].item() == eos)
    assert max(r.numel() for r in stopped.responses[1:]) > step + 1


def test_progress_callback_sees_every_step(single_process):
    hf, model = _model("qwen3.5-debug")
    seen = []
    with torch.no_grad():
        state = capture_prompt(model, _prompt(hf), CHUNK)
        generate_from_state(model, state, 2, 4, temperature=0.0, progress=seen.append)
    assert [(p.step, p.active, p.finished, p.generated_tokens) for p in seen] == [
        (1, 2, 0, 2), (2, 2, 0, 4), (3, 2, 0, 6), (4, 0, 2, 8)]
    assert all(p.max_new_tokens == 4 and p.elapsed_s >= 0 for p in seen)


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_refused(single_process):
    hf, model = _model("qwen3.5-debug")
    with torch.no_grad():
        state = capture_prompt(model, _prompt(hf, 8), 4)
        for kwargs, message in (
            (dict(temperature=-0.5), "--temperature must be >= 0"),
            (dict(top_p=0.0), r"--top-p must be in \(0, 1\]"),
            (dict(top_p=1.5), r"--top-p must be in \(0, 1\]"),
        ):
            with pytest.raises(ValueError, match=message):
                generate_from_state(model, state, 2, 4, **kwargs)
        with pytest.raises(ValueError, match="--max-response-length 4089 after a 8-token prompt exceeds "
                                             "the model's 4096 positions"):
            generate_from_state(model, state, 2, 4089)
        _, other = _model("glm-5-debug")
        with pytest.raises(ValueError, match="prompt state was captured with a different model"):
            generate_from_state(other, state, 2, 4)
        two = capture_prompt(model, torch.cat([_prompt(hf, 8)] * 2), 4)
        with pytest.raises(ValueError, match="decoding needs a prompt state of batch 1"):
            generate_from_state(model, two, 2, 4)
        state.last_logits_BV[0, 3] = float("nan")  # a forward that overflowed
        with pytest.raises(FloatingPointError, match="logits after the prompt are not finite"):
            generate_from_state(model, state, 2, 4)


# ----------------------------------------------------------------------------- tensor parallelism


def test_tp2_rollouts_match_tp1(single_process):
    """Vocabulary-sharded logits gathered for sampling: TP=2 greedy and sampled tokens equal TP=1's,
    logits within 1e-5, on both ranks; Qwen3.5 without and with sequence parallelism, GLM-5 with it
    (Megatron's MLA needs it under TP). Under sequence parallelism a decode step's one token per
    sample is padded to TP rows, and the layers keep state of the real row only."""
    hf = resolve_hf_config("qwen3.5-debug")
    prompt = _prompt(hf)
    temperatures = (0.0, 1.0)
    models = (("qwen3.5-debug", False), ("qwen3.5-debug", True), ("glm-5-debug", True))
    reference = {}
    for preset in {preset for preset, _ in models}:
        model = sharded_output_model(preset)
        reference[preset] = {t: rollouts(model, prompt, CHUNK, SAMPLES, NEW, t, seed=9) for t in temperatures}
    results = run_multiprocess(tp_rollout_worker, 2, models, 2, prompt, CHUNK, SAMPLES, NEW, temperatures, 9)
    for rank, result in enumerate(results):
        for preset, sp in models:
            for t in temperatures:
                (want_tokens, want_logits), (got_tokens, got_logits) = reference[preset][t], result[preset, sp][t]
                assert [r.tolist() for r in got_tokens] == [r.tolist() for r in want_tokens], (rank, preset, sp, t)
                for got, want in zip(got_logits, want_logits):
                    assert (got - want).abs().max().item() <= 1e-5, (rank, preset, sp, t)


# ----------------------------------------------------------------------------- decode attention


@pytest.mark.parametrize("split", [1_000_000, 5, 23, 1])
def test_decode_attention_equals_one_softmax(split):
    """[shared batch-1 prompt keys; own keys] with bottom-right causal new queries equals one
    softmax over the prompt expanded per sample plus the own keys; the 23 prompt keys in one
    piece, in 4 pieces of 5 and a rest of 3, in one whole piece, and in 23 pieces of one key."""
    gen = torch.Generator().manual_seed(0)
    prompt, own, seq, batch, heads, groups, dim = 23, 6, 2, 3, 6, 2, 8
    q = torch.randn(seq, batch, heads, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(own, batch, groups, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    pk, pv = (torch.randn(prompt, 1, groups, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    got = decode_attention(q, k, v, pk, pv, options=KernelOptions(decode_split_keys=split))
    # reference: the earlier own keys join the prefix (all visible), the newest ``seq`` are causal
    ref_pk = torch.cat([pk.expand(-1, batch, -1, -1), k[: own - seq]])
    ref_pv = torch.cat([pv.expand(-1, batch, -1, -1), v[: own - seq]])
    want = prefix_causal_attention_math(q, k[own - seq:], v[own - seq:], ref_pk, ref_pv)
    assert (got - want).abs().max().item() < 1e-12


# ----------------------------------------------------------------------------- sampling functions


def test_temperature_scales_logits():
    logits = torch.tensor([[2.0, 0.0, -2.0]])
    assert torch.equal(scale_logits(logits, 2.0), torch.tensor([[1.0, 0.0, -1.0]]))
    probs = sampling_probs(torch.log(torch.tensor([[0.5, 0.25, 0.25]])), 0.5, 1.0)
    assert torch.allclose(probs, torch.tensor([[4 / 6, 1 / 6, 1 / 6]]))  # p^2 renormalized


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.125, 0.5, 0.125, 0.25]]))  # sorted: 1, 3, then 0 = 2 tied
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].nonzero()[:, 0].tolist()
    assert kept(0.5) == [1]          # 0.5 >= 0.5 already
    assert kept(0.3) == [1]          # the top token always stays
    assert kept(0.75) == [1, 3]      # mass before token 3 is 0.5 < 0.75; after it 0.75
    assert kept(0.76) == [0, 1, 3]   # one of the tied 0.125s: the lower id, 0
    assert kept(0.875) == [0, 1, 3]
    assert kept(0.9) == [0, 1, 2, 3]
    assert kept(1.0) == [0, 1, 2, 3]
    probs = sampling_probs(logits, 1.0, 0.75)
    assert torch.allclose(probs, torch.tensor([[0.0, 2 / 3, 0.0, 1 / 3]]))
    logq = sampling_logprobs(logits, torch.tensor([3]), 1.0, 0.75)
    assert torch.allclose(logq, torch.log(torch.tensor([1 / 3])))
    uniform = torch.zeros(2, 4)
    assert torch.isfinite(top_p_filter(uniform, 0.5)).tolist() == [[True, True, False, False]] * 2


def test_sample_tokens_greedy_and_seeded():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample_tokens(logits, 0.0, 1.0).tolist() == [1, 0]  # ties -> lowest id
    draw = lambda seed: sample_tokens(logits.repeat(1000, 1), 1.0, 0.9, torch.Generator().manual_seed(seed))
    first = draw(3)
    assert torch.equal(first, draw(3)) and not torch.equal(first, draw(4))
    # row 0: p = [.023, .458, .458, .062]; top-p 0.9 keeps tokens 1 and 2 only (mass .915 before 3)
    counts = torch.bincount(first[0::2], minlength=4).tolist()
    assert counts[0] == counts[3] == 0 and min(counts[1], counts[2]) > 400
    assert (first[1::2] == 0).all()  # row 1: p(0) = .98 >= 0.9 alone


def test_sampling_settings_are_checked():
    check_sampling(0.0, 1.0)
    for temperature, top_p, flag in ((-1.0, 1.0, "--temperature"), (float("nan"), 1.0, "--temperature"),
                                     (1.0, 0.0, "--top-p"), (1.0, 1.01, "--top-p")):
        with pytest.raises(ValueError, match=flag):
            check_sampling(temperature, top_p)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 1.0), (1.0, 0.8), (1.3, 0.6)])
def test_token_distribution_matches_the_sampling_functions(temperature, top_p):
    """A decoding step's draw and log-probabilities from one ``TokenDistribution``: the same
    scores as ``token_logprobs_full_vocab`` and ``sampling_logprobs`` (1e-5), greedy = argmax,
    and draws whose frequencies follow ``sampling_probs`` (4,000 draws per row)."""
    from megatron_longstraw.rollout.sampling import TokenDistribution, log_softmax_rows, token_logprobs_full_vocab

    logits = 2 * torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    dist = TokenDistribution(logits, temperature, top_p)
    assert torch.allclose(log_softmax_rows(logits), logits.log_softmax(-1), atol=1e-6)
    tokens = torch.tensor([0, 5, 10])
    if temperature > 0:  # score tokens the sampling distribution keeps
        tokens = sampling_probs(logits, temperature, top_p).argmax(-1)
    model, sampling = dist.scores(tokens)
    assert torch.allclose(model, token_logprobs_full_vocab(logits, tokens), atol=1e-5)
    assert torch.allclose(sampling, sampling_logprobs(logits, tokens, temperature, top_p), atol=1e-5)
    if temperature == 0:
        assert torch.equal(dist.draw(), logits.argmax(-1))
        return
    many = TokenDistribution(logits.repeat_interleave(4000, 0), temperature, top_p).draw(torch.Generator().manual_seed(1))
    counts = torch.stack([torch.bincount(many[i * 4000:(i + 1) * 4000], minlength=11) for i in range(3)]) / 4000
    probs = sampling_probs(logits, temperature, top_p)
    assert (counts - probs).abs().max().item() < 0.03
    assert not counts[probs == 0].any()  # nothing outside the nucleus
    # a token outside the nucleus scores -inf; a masked (-inf) logit is never drawn
    if top_p < 1:
        row, token = (probs == 0).nonzero()[0].tolist()
        tokens = probs.argmax(-1)
        tokens[row] = token
        assert dist.scores(tokens)[1][row] == float("-inf")
    masked = logits.clone()
    masked[:, 0] = float("-inf")
    drawn = TokenDistribution(masked.repeat_interleave(500, 0), temperature, top_p).draw(torch.Generator().manual_seed(2))
    model_lp, _ = TokenDistribution(masked, temperature, top_p).scores(torch.tensor([0, 0, 0]))
    assert not (drawn == 0).any() and (model_lp == float("-inf")).all()
