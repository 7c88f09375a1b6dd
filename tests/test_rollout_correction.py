"""Rollout correction (``grpo/rollout_correction.py``): the TIS/MIS weights by hand, in the losses,
the sampler's log-probs in rollout JSONL, and a run whose sampler drew at another temperature."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

import train_grpo
from megatron_longstraw.config.grpo import LossConfig
from megatron_longstraw.data.external_rollouts import ExternalRolloutDataset
from megatron_longstraw.distributed import destroy_distributed, init_distributed
from megatron_longstraw.grpo.losses.grpo import GRPOLoss
from megatron_longstraw.grpo.losses.gspo import GSPOLoss
from megatron_longstraw.grpo.rollout_correction import sequence_weights, token_weights
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.rollout.generate import generate_from_state
from megatron_longstraw.training import loop
from megatron_longstraw.training.setup import build_policy, build_prompt_source

LOG = math.log


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_token_weights_by_hand():
    old = torch.tensor([[LOG(0.5)], [LOG(0.2)], [LOG(0.3)]])
    sampler = torch.tensor([[LOG(0.25)], [LOG(0.4)], [LOG(0.3)]])  # ratios 2, 0.5, 1
    weight, corrected = token_weights(old, sampler, "tis", 1.5)
    torch.testing.assert_close(weight, torch.tensor([[1.5], [0.5], [1.0]]))
    assert corrected[:, 0].tolist() == [True, False, False]
    weight, corrected = token_weights(old, sampler, "mis", 1.5)  # keep ratios in [1/1.5, 1.5], weighted
    torch.testing.assert_close(weight, torch.tensor([[0.0], [0.0], [1.0]]))
    assert corrected[:, 0].tolist() == [True, True, False]
    weight, corrected = token_weights(old, sampler, "mis", 2.5)
    torch.testing.assert_close(weight, torch.tensor([[2.0], [0.5], [1.0]]))
    assert not corrected.any()
    weight, corrected = token_weights(old, sampler, "none", 1.5)
    assert weight[:, 0].tolist() == [1.0, 1.0, 1.0] and not corrected.any()
    huge, _ = token_weights(torch.tensor([[0.0]]), torch.tensor([[-200.0]]), "tis", 3.0)  # exp overflows
    assert huge.item() == 3.0


def test_sequence_weights_use_the_geometric_mean():
    old = torch.tensor([[LOG(0.5), LOG(0.5)], [LOG(0.2), 0.0]])
    sampler = torch.tensor([[LOG(0.25), LOG(0.125)], [LOG(0.4), 5.0]])  # sample 1 has one real token
    real = torch.tensor([[True, True], [True, False]])
    weight, corrected = sequence_weights(old, sampler, real, "tis", 1.5)
    # sample 0: ratios 2 and 0.5 -> geometric mean 1; sample 1: ratio 4 -> capped
    torch.testing.assert_close(weight, torch.tensor([1.0, 1.5]))
    assert corrected.tolist() == [False, True]


@pytest.mark.parametrize("mode,cap,needle", [("clip", 2.0, "--rollout-correction must be one of none, tis, mis"),
                                              ("tis", 0.5, "--rollout-correction-cap must be a finite number >= 1"),
                                              ("mis", float("inf"), "--rollout-correction-cap must be")])
def test_bad_correction_flags(mode, cap, needle):
    with pytest.raises(ValueError, match=needle):
        LossConfig(rollout_correction=mode, rollout_correction_cap=cap)


def _grpo(old, sampler, mode, cap, advantages):
    config = LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, rollout_correction=mode, rollout_correction_cap=cap)
    return GRPOLoss(old, torch.tensor(advantages), normalizer=1.0, config=config, sampler_logprobs=sampler)


def test_tis_weighs_the_policy_gradient_and_logs_the_gap():
    old = [_t(LOG(0.5), LOG(0.2)), _t(LOG(0.3))]
    sampler = [_t(LOG(0.25), LOG(0.4)), _t(LOG(0.1))]  # ratios 2, 0.5 | 3
    new = torch.tensor([[LOG(0.55), LOG(0.3)], [LOG(0.25), 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    loss_fn = _grpo(old, sampler, "tis", 2.5, [1.0, -1.0])
    loss_fn(new, mask, [0, 1]).backward()
    # by hand: token terms -min(r A, clip(r) A) with r = new/old, weights min(old/sampler, 2.5)
    r = [0.55 / 0.5, 0.25 / 0.2, 0.3 / 0.3]
    weights = [2.0, 0.5, 2.5]
    advantages = [1.0, 1.0, -1.0]
    expected = 0.0
    grads = []
    for ratio, w, a in zip(r, weights, advantages):
        clipped = min(max(ratio, 0.8), 1.2)
        expected += -w * min(ratio * a, clipped * a)
        unclipped_wins = ratio * a <= clipped * a
        grads.append(-w * a * ratio if unclipped_wins else 0.0)  # d/dlogp of -w r A
    positions = [(0, 0), (1, 0), (0, 1)]
    for (t, b), g in zip(positions, grads):
        assert abs(new.grad[t, b].item() - g) < 1e-12, (t, b, new.grad[t, b].item(), g)
    assert new.grad[1, 1].item() == 0.0
    metrics = loss_fn.logged_metrics()
    assert abs(metrics["rollout/weight_mean"] - sum(weights) / 3) < 1e-6
    assert metrics["rollout/weight_min"] == pytest.approx(0.5) and metrics["rollout/weight_max"] == pytest.approx(2.5)
    assert metrics["rollout/corrected_frac"] == pytest.approx(1 / 3)
    gaps = [abs(LOG(2.0)), abs(LOG(0.5)), abs(LOG(3.0))]
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(sum(gaps) / 3)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(LOG(3.0))
    assert metrics["loss/policy"] == pytest.approx(expected / 3)


def test_mis_masks_the_policy_term_only():
    old = [_t(LOG(0.5), LOG(0.2))]
    sampler = [_t(LOG(0.25), LOG(0.19))]  # ratios 2 (masked at cap 1.5) and ~1.05 (kept)
    new = torch.tensor([[LOG(0.6)], [LOG(0.21)]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 1, dtype=torch.float64)
    loss_fn = _grpo(old, sampler, "mis", 1.5, [1.0])
    loss_fn(new, mask, [0]).backward()
    # the masked token gets no policy gradient; the kept one its ratio (0.2 / 0.19) times the plain one
    r = 0.21 / 0.2
    assert new.grad[0, 0].item() == 0.0 and new.grad[1, 0].item() == pytest.approx(-(0.2 / 0.19) * r, rel=1e-12)
    assert loss_fn.logged_metrics()["rollout/corrected_frac"] == 0.5


def test_gspo_weighs_each_response():
    old = [_t(LOG(0.5), LOG(0.5)), _t(LOG(0.2))]
    sampler = [_t(LOG(0.25), LOG(1.0)), _t(LOG(0.05))]  # geometric means 1 and 4
    new = torch.tensor([[LOG(0.5), LOG(0.2)], [LOG(0.5), 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    plain = GSPOLoss(old, torch.tensor([1.0, 1.0]), normalizer=1.0,
                     config=LossConfig(clip_eps_low=0.5, clip_eps_high=0.5))
    weighted = GSPOLoss(old, torch.tensor([1.0, 1.0]), normalizer=1.0, sampler_logprobs=sampler,
                        config=LossConfig(clip_eps_low=0.5, clip_eps_high=0.5, rollout_correction="tis",
                                          rollout_correction_cap=3.0))
    plain(new, mask, [0, 1]).backward()
    g_plain = new.grad.clone()
    new.grad = None
    weighted(new, mask, [0, 1]).backward()
    torch.testing.assert_close(new.grad[:, 0], g_plain[:, 0])  # weight 1
    torch.testing.assert_close(new.grad[0, 1], 3.0 * g_plain[0, 1])  # weight min(4, 3)
    metrics = weighted.logged_metrics()
    assert metrics["rollout/weight_mean"] == pytest.approx(2.0) and metrics["rollout/corrected_frac"] == 0.5


def test_a_correction_without_sampler_logprobs_is_refused():
    with pytest.raises(ValueError, match="--rollout-correction tis needs the sampler's log-probs"):
        _grpo([torch.zeros(2)], None, "tis", 2.0, [1.0])


def _dataset(tmp_path, record, **kwargs):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n" if record is None else
                    json.dumps({"prompt_ids": [1, 2, 3], **record}) + "\n")
    return ExternalRolloutDataset(str(path), num_generations=2, vocab_size=50, validate=False, **kwargs), path


@pytest.mark.parametrize("logprobs,needle", [
    ([[-0.1, -0.2]], "'logprobs' must be a list of 2 lists (one per response), got 1 entries"),
    ([[-0.1, -0.2], [-0.3]], "'logprobs[1]' has 1 values, 'responses[1]' has 3 tokens"),
    ([[-0.1, -0.2], [-0.3, float("nan"), -0.1]], "'logprobs[1][1]' is nan; a log-prob must be a finite number <= 0"),
    ([[-0.1, 0.5], [-0.3, -0.2, -0.1]], "'logprobs[0][1]' is 0.5"),
    ([[-0.1, -0.2], "x"], "'logprobs[1]' must be a list of numbers, got str"),
])
def test_bad_logprobs_name_the_file_and_line(tmp_path, logprobs, needle):
    dataset, path = _dataset(tmp_path, {"responses": [[4, 5], [6, 7, 8]], "logprobs": logprobs})
    with pytest.raises(ValueError) as err:
        dataset[0]
    assert str(err.value) == f"{path}:1: {needle}" or str(err.value).startswith(f"{path}:1: {needle}"), str(err.value)


def test_logprobs_are_read_and_need_token_ids(tmp_path):
    dataset, _ = _dataset(tmp_path, {"responses": [[4, 5], [6, 7, 8]], "logprobs": [[-0.1, -0.2], [-0.3, 0, -1]]})
    group = dataset[0]
    assert [lp.tolist() for lp in group.sampler_logprobs] == [pytest.approx([-0.1, -0.2]), pytest.approx([-0.3, 0, -1])]
    assert all(lp.dtype == torch.float32 for lp in group.sampler_logprobs)
    tokenizer = SimpleNamespace(tokenize=lambda text, add_special_tokens=False: [4, 5], eos_id=49, vocab_size=50)
    dataset, path = _dataset(tmp_path, {"responses": ["four five", [6, 7]], "logprobs": [[-0.1, -0.2], [-0.3, -1]]},
                             tokenizer=tokenizer)
    with pytest.raises(ValueError, match=f"{path}:1: 'logprobs' needs token-id responses"):
        dataset[0]


def _run_args(tmp_path, *extra):
    return ["--train-iters", "1", "--global-batch-size", "1", "--num-generations", "3", "--prompt-chunk-size", "16",
            "--max-response-length", "6", "--lr", "1e-2", "--no-save", "--wandb-save-dir", str(tmp_path / "wandb"),
            "--wandb-mode", "disabled", "--seed", "5", *extra]


def test_logprobs_of_another_temperature_get_their_weights_and_train(tmp_path):
    """The run's own initial policy samples at temperature 0.6 (in this process, as the trainer
    builds it); the file carries that sampler's log-probs; training with TIS weighs every token by
    min(pi_old / pi_sampler, cap), pi_old at temperature 1, and logs exactly those weights."""
    args = train_grpo.parse_args(_run_args(tmp_path, "--synthetic-prompt-length", "40"))
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        hf, model, _, _ = build_policy(args)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        prompt = torch.randint(0, hf["vocab_size"], (40,), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            state = capture_prompt(model, prompt[None], 16)
            rollouts = generate_from_state(model, state, 3, 6, temperature=0.6,
                                           generator=torch.Generator().manual_seed(3))
            state.free()
    finally:
        destroy_distributed()
    log_ratio = torch.cat([a - b for a, b in zip(rollouts.logprobs, rollouts.sampling_logprobs)])
    cap = max(1.0, log_ratio.exp().median().item())  # some tokens truncated, some not
    expected = log_ratio.exp().clamp(max=cap)
    assert 0 < (log_ratio.exp() > cap).float().mean() < 1
    record = {"prompt_ids": prompt.tolist(), "responses": [r.tolist() for r in rollouts.responses],
              "logprobs": [lp.tolist() for lp in rollouts.sampling_logprobs], "rewards": [0.0, 1.0, 0.5]}
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps(record) + "\n")
    args = train_grpo.parse_args(_run_args(tmp_path, "--rollout-source", "jsonl", "--rollout-path", str(path),
                                           "--rollout-correction", "tis", "--rollout-correction-cap", str(cap)))
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        metrics, model = loop.train(args)
        moved = any(not torch.equal(p.detach(), initial[n]) for n, p in model.named_parameters())
    finally:
        destroy_distributed()
    assert metrics["rollout/weight_mean"] == pytest.approx(expected.mean().item(), abs=1e-5)
    assert metrics["rollout/weight_min"] == pytest.approx(expected.min().item(), abs=1e-5)
    assert metrics["rollout/weight_max"] == pytest.approx(expected.max().item(), abs=1e-5)
    assert metrics["rollout/corrected_frac"] == pytest.approx((log_ratio.exp() > cap).float().mean().item())
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(log_ratio.abs().max().item(), abs=1e-5)
    assert math.isfinite(metrics["loss/total"]) and metrics["optim/grad_norm"] > 0 and moved


def test_a_correction_needs_logprobs_in_the_record(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps({"prompt_ids": list(range(1, 30)), "responses": [[3, 4], [5], [6, 7]],
                                "rewards": [0, 1, 0]}) + "\n")
    args = train_grpo.parse_args(_run_args(tmp_path, "--rollout-source", "jsonl", "--rollout-path", str(path),
                                           "--rollout-correction", "mis"))
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        with pytest.raises(ValueError, match=f"{path}:1: --rollout-correction mis needs the sampler's 'logprobs'"):
            build_prompt_source(args, resolve_hf_config("qwen3.5-debug"), SimpleNamespace(eos_id=255, vocab_size=256))
    # found at start-up (the file's validation pass), before any model is built
    finally:
        destroy_distributed()
