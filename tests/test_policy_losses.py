"""The registered policy losses (``--loss-type``) against hand-computed values in fp64: Dr. GRPO,
GSPO, CISPO, the KL / entropy terms every loss shares, the trainer hooks (normalizers, end-of-step
gradient scale, metric names), the flag validation at start-up and the registry."""

import math
import pytest
import torch

from megatron_longstraw.config.grpo import LossConfig
from megatron_longstraw.grpo.advantages import group_advantages
from megatron_longstraw.grpo.loss_base import PolicyLoss, StepShape
from megatron_longstraw.grpo.losses.cispo import CISPOLoss
from megatron_longstraw.grpo.losses.dr_grpo import DrGRPOLoss
from megatron_longstraw.grpo.losses.grpo import GRPOLoss
from megatron_longstraw.grpo.losses.gspo import GSPOLoss
from megatron_longstraw.grpo.registry import POLICY_LOSSES, get_policy_loss, register_policy_loss
from megatron_longstraw.training.arguments import parse_args

F64 = torch.float64
NAN = float("nan")


def _columns(old, log_ratios):
    """New log-probs ``old + log_ratio`` per sample as fp64 leaves, the old ones detached."""
    old = [torch.tensor(o, dtype=F64) for o in old]
    new = [(o + torch.tensor(d, dtype=F64)).requires_grad_() for o, d in zip(old, log_ratios)]
    return new, old


def _pad(columns, fill=NAN):
    """Right-pad 1-D tensors (autograd kept) into fp64 ``[R, B]`` plus the mask; padding holds NaN."""
    length = max(c.numel() for c in columns)
    out_RB = torch.full((length, len(columns)), fill, dtype=F64)
    mask_RB = torch.zeros(length, len(columns), dtype=F64)
    for b, c in enumerate(columns):
        out_RB[: c.numel(), b] = c
        mask_RB[: c.numel(), b] = 1.0
    return out_RB, mask_RB


def _run(loss_fn, new, splits, entropy=None):
    """Sum of the micro-batch losses of ``splits`` (lists of sample indices), backpropagated."""
    total = 0.0
    for indices in splits:
        logprobs_RB, mask_RB = _pad([new[i] for i in indices])
        entropy_RB = None if entropy is None else _pad([entropy[i] for i in indices])[0]
        loss = loss_fn(logprobs_RB, mask_RB, indices, entropy_RB)
        loss.backward()
        total += loss.item()
    return total


def _step(groups_per_rank=1, data_parallel_size=1) -> StepShape:
    """A step of ``groups_per_rank`` groups per rank on ``data_parallel_size`` ranks, responses of
    at most 4 tokens (``--max-response-length``)."""
    return StepShape(groups_per_rank=groups_per_rank, data_parallel_size=data_parallel_size, max_response_length=4)


# ---- Dr. GRPO -----------------------------------------------------------------------------------

def test_dr_grpo_sums_tokens_over_the_constant_normalizer():
    # eps 0.2 / 0.28; sample 0 (A +1): r 1.1, 0.9 inside (-r, grad -1.1, -0.9), r 1.5 clipped high
    # (-1.28, grad 0); sample 1 (A -0.5): r 1.2 inside (0.6, grad 0.6).
    # normalizer --max-response-length 4 x 2 responses x 1 group = 8 (no 1/length: a GRPO
    # sequence mean would weigh sample 1's token 3x sample 0's)
    # loss (-1.1 - 0.9 - 1.28 + 0.6) / 8 = -0.335; grads (-1.1, -0.9, 0) / 8 and 0.6 / 8
    new, old = _columns([[-0.7, -2.0, -1.1], [-0.3]], [[math.log(1.1), math.log(0.9), math.log(1.5)],
                                                        [math.log(1.2)]])
    config = LossConfig(loss_type="dr_grpo")
    DrGRPOLoss.check_config(config)
    assert (DrGRPOLoss.aggregation_of(config), DrGRPOLoss.advantage_normalization(config)) == ("token", "none")
    loss_fn = DrGRPOLoss.for_group(config, _step(), old, torch.tensor([1.0, -0.5]), ref_logprobs=None)
    assert loss_fn.normalizer == 8.0
    assert _run(loss_fn, new, [[0, 1]]) == pytest.approx(-0.335, abs=1e-12)
    torch.testing.assert_close(new[0].grad, torch.tensor([-1.1 / 8, -0.9 / 8, 0.0], dtype=F64))
    torch.testing.assert_close(new[1].grad, torch.tensor([0.6 / 8], dtype=F64))
    metrics = loss_fn.metrics()
    assert metrics["clip_frac_high"] == pytest.approx(0.25) and metrics["clip_frac_low"] == 0.0
    # the normalizer is per rank: 4 x 3 responses x 2 groups; DDP's average divides by the DP size
    assert DrGRPOLoss.for_group(config, _step(groups_per_rank=2), [torch.zeros(1)] * 3, torch.zeros(3),
                                ref_logprobs=None).normalizer == 24.0


def test_dr_grpo_advantages_are_only_centred():
    # rewards 1, 0, 0: mean 1/3 -> 2/3, -1/3, -1/3 (group-std would give 1.1547, -0.5774, -0.5774)
    config = LossConfig(loss_type="dr_grpo")
    DrGRPOLoss.check_config(config)
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 0.0, 0.0]),
                                                DrGRPOLoss.advantage_normalization(config)),
                               torch.tensor([2 / 3, -1 / 3, -1 / 3]))
    with pytest.raises(ValueError, match="--advantage-normalization"):
        DrGRPOLoss.check_config(LossConfig(loss_type="dr_grpo", advantage_normalization="group-std"))
    with pytest.raises(ValueError, match="--loss-aggregation"):
        DrGRPOLoss.check_config(LossConfig(loss_type="dr_grpo", loss_aggregation="sequence"))


# ---- GSPO ---------------------------------------------------------------------------------------

# seq 0 (A +1): log ratios 0.1, 0.3 -> s = exp(0.2) = 1.2214028
# seq 1 (A -1): log ratio -0.5 -> s = exp(-0.5) = 0.6065307
# seq 2 (A +0.5): log ratios 0, 0.2, -0.2 -> s = 1
GSPO_OLD = [[-0.7, -1.9], [-0.4], [-2.0, -0.1, -1.3]]
GSPO_LOG_RATIOS = [[0.1, 0.3], [-0.5], [0.0, 0.2, -0.2]]
GSPO_ADVANTAGES = [1.0, -1.0, 0.5]


@pytest.mark.parametrize("eps, loss, grads", [
    # eps 0.2 / 0.28: seq 0 inside, -s = -1.2214028, grad -A s / |y| = -0.6107014 per token;
    # seq 1 below 0.8 with A < 0: clipped, -(-0.8) = 0.8, no grad; seq 2: -0.5, grad -0.5 / 3.
    # mean over 3 sequences: (-1.2214028 + 0.8 - 0.5) / 3 = -0.3071343; grads / 3
    ((0.2, 0.28), -0.3071342527200566, ([-0.2035671263600283] * 2, [0.0], [-0.5 / 9] * 3)),
    # GSPO's own tiny range 3e-4 / 4e-4: seq 0 clipped high (-1.0004), seq 1 clipped low (0.9997)
    # seq 2 unclipped: (-1.0004 + 0.9997 - 0.5) / 3 = -0.1669
    ((3e-4, 4e-4), -0.1669, ([0.0] * 2, [0.0], [-0.5 / 9] * 3)),
])
def test_gspo_sequence_ratio_value_and_gradient(eps, loss, grads):
    new, old = _columns(GSPO_OLD, GSPO_LOG_RATIOS)
    config = LossConfig(loss_type="gspo", clip_eps_low=eps[0], clip_eps_high=eps[1])
    GSPOLoss.check_config(config)
    assert GSPOLoss.aggregation_of(config) == "sequence"
    loss_fn = GSPOLoss.for_group(config, _step(), old, torch.tensor(GSPO_ADVANTAGES), ref_logprobs=None)
    assert loss_fn.normalizer == 3.0
    assert _run(loss_fn, new, [[0, 1, 2]]) == pytest.approx(loss, abs=1e-12)
    for tensor, expected in zip(new, grads):
        torch.testing.assert_close(tensor.grad, torch.tensor(expected, dtype=F64))
    metrics = loss_fn.metrics()
    if eps == (0.2, 0.28):  # per-sequence metrics: one sequence of three clipped low
        assert metrics == pytest.approx({
            "policy_loss": -0.3071343, "clip_frac_low": 1 / 3, "clip_frac_high": 0.0,
            "sequence_ratio_mean": 0.9426445, "sequence_ratio_max": 1.2214028, "ratio_mean": 1.0169490,
            "ratio_max": math.exp(0.3), "approx_kl": metrics["approx_kl"], "tokens": 6.0}, abs=1e-6)
        logged = loss_fn.logged_metrics()
        assert logged["ratio/sequence_mean"] == pytest.approx(0.9426445, abs=1e-6)
        assert logged["clip/frac_low"] == pytest.approx(1 / 3) and "tokens" not in logged


def test_gspo_equals_gspo_token_and_micro_batches_add_up():
    """GSPO-token (``s_i,t = sg[s_i] pi / sg[pi]``, the token mean per sequence) has GSPO's value
    and gradient; and micro-batches of whole responses add up to one batch."""
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 2, 4, 1)
    old = [-torch.rand(n, generator=gen, dtype=F64) * 3 for n in lengths]
    deltas = [torch.randn(n, generator=gen, dtype=F64) * 0.05 for n in lengths]
    advantages = torch.tensor([1.2, -0.4, 0.3, -1.1], dtype=F64)
    low, high = 0.01, 0.02

    new = [(o + d).requires_grad_() for o, d in zip(old, deltas)]
    expected = 0.0
    for logp, o, a in zip(new, old, advantages):
        s = torch.exp((logp - o).mean())
        s_t = s.detach() * torch.exp(logp - logp.detach())
        expected = expected - torch.minimum(s_t * a, s_t.clamp(1 - low, 1 + high) * a).mean()
    (expected / 4).backward()
    token_grads = [t.grad.clone() for t in new]
    assert any((g != 0).any() for g in token_grads) and any((g == 0).all() for g in token_grads)  # some clip

    for splits in ([[0, 1, 2, 3]], [[0, 1], [2], [3]]):
        for t in new:
            t.grad = None
        loss_fn = GSPOLoss(old, advantages, normalizer=4.0, config=LossConfig(clip_eps_low=low, clip_eps_high=high))
        assert _run(loss_fn, new, splits) == pytest.approx(expected.item() / 4, abs=1e-12)
        for got, want in zip(new, token_grads):
            torch.testing.assert_close(got.grad, want)


# ---- CISPO --------------------------------------------------------------------------------------

def test_cispo_gradient_is_minus_clipped_weight_times_advantage():
    # old p 0.5 for every token; eps 0.2 / 0.28: w = clip(r, 0.8, 1.28)
    # sample 0 (A +2): r 1.5, 1.1, 0.5 -> w 1.28, 1.1, 0.8; sample 1 (A -1): r 0.75 -> w 0.8
    # per token -w A logp: -2.56 log 0.75 = 0.7364661, -2.2 log 0.55 = 1.3152414,
    # -1.6 log 0.25 = 2.2180710, 0.8 log 0.375 = -0.7846634; sum 3.4851151 / 4 tokens = 0.8712788
    # gradient -w A / 4: (-2.56, -2.2, -1.6) / 4 and 0.8 / 4. Through the weight it would differ:
    # d(-r A logp)/dlogp = -A r (1 + logp) on the unclipped tokens; and PPO's clip would give
    # (0, -2.2, -1.0) / 4 to sample 0
    half = math.log(0.5)
    new, old = _columns([[half] * 3, [half]], [[math.log(1.5), math.log(1.1), math.log(0.5)], [math.log(0.75)]])
    # (in the trainer the normalizer is 1 and finish_step scales by the global token count)
    loss_fn = CISPOLoss(old, torch.tensor([2.0, -1.0]), normalizer=4.0,
                        config=LossConfig(clip_eps_low=0.2, clip_eps_high=0.28))
    assert _run(loss_fn, new, [[0, 1]]) == pytest.approx(3.4851151 / 4, abs=1e-7)
    torch.testing.assert_close(new[0].grad, torch.tensor([-2.56 / 4, -2.2 / 4, -1.6 / 4], dtype=F64))
    torch.testing.assert_close(new[1].grad, torch.tensor([0.8 / 4], dtype=F64))
    metrics = loss_fn.metrics()
    # weights clipped: low r 0.5 and 0.75 (2 of 4 tokens), high r 1.5 (1 of 4)
    assert (metrics["clip_frac_low"], metrics["clip_frac_high"]) == pytest.approx((0.5, 0.25))
    assert metrics["policy_loss"] == pytest.approx(3.4851151 / 4, abs=1e-6)
    with pytest.raises(ValueError, match="--loss-aggregation"):
        CISPOLoss.check_config(LossConfig(loss_type="cispo", loss_aggregation="sequence"))


# ---- KL and entropy, shared by every loss -------------------------------------------------------

@pytest.mark.parametrize("cls, kwargs, per_sequence", [
    (GRPOLoss, dict(loss_aggregation="token"), False), (GRPOLoss, dict(loss_aggregation="sequence"), True),
    (DrGRPOLoss, {}, False), (CISPOLoss, {}, False), (GSPOLoss, {}, True)])
def test_kl_and_entropy_terms_in_every_loss(cls, kwargs, per_sequence):
    # zero advantages: only the regularizers remain. new = old (ratio 1), ref = logp + log 0.5:
    # k3 = 0.5 - log 0.5 - 1 = 0.1931472, d k3 / d logp = 0.5; entropy 0.3 everywhere.
    # per token 0.1 * 0.1931472 - 0.01 * 0.3 = 0.0163147; lengths 2 and 1, normalizer 2:
    # token sum 3 * 0.0163147 / 2, grad 0.05 / 2 (entropy -0.01 / 2); sequence means 2 * 0.0163147 / 2,
    # grads over each length too
    new, old = _columns([[-0.7, -2.0], [-0.1]], [[0.0, 0.0], [0.0]])
    ref = [o + math.log(0.5) for o in old]
    entropy = [torch.full((2,), 0.3, dtype=F64, requires_grad=True), torch.full((1,), 0.3, dtype=F64,
                                                                                requires_grad=True)]
    loss_fn = cls(old, torch.zeros(2), normalizer=2.0, ref_logprobs=ref,
                  config=LossConfig(kl_coef=0.1, entropy_coef=0.01, **kwargs))
    term = 0.1 * (0.5 - math.log(0.5) - 1) - 0.01 * 0.3
    weights = ([0.5, 0.5], [1.0]) if per_sequence else ([1.0, 1.0], [1.0])
    assert _run(loss_fn, new, [[0, 1]], entropy) == pytest.approx(term * sum(map(sum, weights)) / 2, abs=1e-12)
    for logp, ent, w in zip(new, entropy, weights):
        torch.testing.assert_close(logp.grad, 0.05 * torch.tensor(w, dtype=F64) / 2)
        torch.testing.assert_close(ent.grad, -0.01 * torch.tensor(w, dtype=F64) / 2)
    assert loss_fn.metrics()["ref_kl"] == pytest.approx(0.1931472)
    assert loss_fn.metrics()["entropy"] == pytest.approx(0.3)


# ---- trainer hooks ------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_type, aggregation, normalizer, total, scale", [
    # 3 responses x 2 groups per rank, DP 2; the step: loss/sum 6, 40 response tokens
    ("grpo", "token", 1.0, 6 / 40, 2 / 40),       # token mean; gradients x dp / tokens before DDP's mean
    ("grpo", "sequence", 6.0, 6 / 2, 1.0),        # this rank's responses, DDP averages the ranks
    ("dr_grpo", "token", 4 * 6.0, 6 / 2, 1.0),    # --max-response-length 4 x this rank's responses
    ("gspo", "sequence", 6.0, 6 / 2, 1.0),
    ("cispo", "token", 1.0, 6 / 40, 2 / 40),
])
def test_group_normalizer_and_end_of_step_scale(loss_type, aggregation, normalizer, total, scale):
    cls = get_policy_loss(loss_type)
    config, step = LossConfig(loss_type=loss_type, loss_aggregation=aggregation), _step(2, data_parallel_size=2)
    cls.check_config(config)
    loss_fn = cls.for_group(config, step, [torch.zeros(2)] * 3, torch.zeros(3), ref_logprobs=None)
    assert loss_fn.normalizer == normalizer
    metrics = {"loss/sum": 6.0, "tokens/response": 40.0}
    assert cls.finish_step(metrics, config, step) == pytest.approx(scale)
    assert metrics == pytest.approx({"loss/total": total, "tokens/response": 40.0})
    assert "loss/sum" in cls.summed_metrics


def test_logged_metric_names():
    loss_fn = GRPOLoss([torch.zeros(2)], torch.tensor([1.0]), ref_logprobs=[torch.zeros(2)], normalizer=2.0)
    loss_fn(torch.zeros(2, 1), torch.ones(2, 1), [0], torch.ones(2, 1))
    assert set(loss_fn.logged_metrics()) == {"loss/policy", "clip/frac_low", "clip/frac_high", "kl/approx",
                                             "kl/reference", "entropy/mean", "ratio/mean", "ratio/max"}


# ---- flags at start-up and the registry -----------------------------------------------------------

def test_trainer_flags_resolve_per_loss():
    defaults = {name: parse_args(["--loss-type", name]).loss for name in ("grpo", "dr_grpo", "gspo", "cispo")}
    assert {n: (get_policy_loss(n).aggregation_of(c), get_policy_loss(n).advantage_normalization(c))
            for n, c in defaults.items()} == {
        "grpo": ("token", "group-std"), "dr_grpo": ("token", "none"), "gspo": ("sequence", "group-std"),
        "cispo": ("token", "group-std")}
    assert parse_args([]).loss.loss_type == "grpo"
    assert GRPOLoss.aggregation_of(parse_args(["--loss-aggregation", "sequence"]).loss) == "sequence"


@pytest.mark.parametrize("argv, needle", [
    (["--loss-type", "gspo", "--loss-aggregation", "token"], "--loss-type gspo takes --loss-aggregation sequence"),
    (["--loss-type", "dr_grpo", "--advantage-normalization", "group-std"], "--advantage-normalization none"),
    (["--loss-type", "cispo", "--loss-aggregation", "sequence"], "--loss-aggregation token"),
    (["--loss-type", "gspo", "--clip-eps-low", "1.0"], "--clip-eps-low"),
    (["--loss-type", "cispo", "--kl-coef", "-1"], "--kl-coef"),
    (["--loss-type", "dr_grpo", "--entropy-coef", "nan"], "--entropy-coef"),
])
def test_bad_loss_flags_fail_at_start_up_naming_the_flag(argv, needle):
    with pytest.raises(ValueError) as err:
        parse_args(argv)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_registry():
    """Every loss of ``grpo/losses/`` is registered where it is defined (its decorator), under the
    names ``--help`` lists, read from the source without importing the losses."""
    assert get_policy_loss("gspo") is GSPOLoss
    builtins = {"grpo", "dr_grpo", "gspo", "cispo", "sft"}
    assert set(POLICY_LOSSES) == builtins
    from megatron_longstraw.grpo.registry import loss_help

    assert [entry.split(" (")[0] for entry in loss_help().removeprefix("Registered: ").rstrip(".").split("), ")] \
        == sorted(builtins)
    assert "gspo (sequence-level ratio and clip)" in loss_help()
    message = "--loss-type must be one of cispo, dr_grpo, grpo, gspo, sft or module:Class, got 'ppo'"
    with pytest.raises(ValueError, match=message):
        get_policy_loss("ppo")
    with pytest.raises(ValueError, match=message):
        parse_args(["--loss-type", "ppo"])  # checked after parsing: the parser imports no loss

    class HalfGRPO(GRPOLoss):
        def loss(self, batch):
            return super().loss(batch) / 2

    try:
        assert register_policy_loss("half_grpo")(HalfGRPO) is HalfGRPO
        assert get_policy_loss("half_grpo") is HalfGRPO and HalfGRPO.name == "half_grpo"
        assert HalfGRPO.aggregation_of(parse_args(["--loss-type", "half_grpo"]).loss) == "token"
        with pytest.raises(ValueError, match="'half_grpo' is already registered"):
            register_policy_loss("half_grpo")(type("Other", (GRPOLoss,), {}))
    finally:
        POLICY_LOSSES.pop("half_grpo", None)
    with pytest.raises(TypeError, match="PolicyLoss subclass"):
        register_policy_loss("x")(object)
    assert issubclass(GRPOLoss, PolicyLoss)
