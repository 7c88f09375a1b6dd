"""GRPO math against hand-computed values (expected numbers are worked out in the comments)."""

import math

import pytest
import torch

from megatron_longstraw.config.grpo import LossConfig
from megatron_longstraw.grpo.advantages import advantage_stats, group_advantages
from megatron_longstraw.grpo.loss_terms import entropy_from_logits, kl_k3
from megatron_longstraw.grpo.losses.grpo import GRPOLoss, aggregate, clipped_surrogate, loss_normalizer

NAN = float("nan")


def _pad(columns, fill=NAN):
    """Right-pad 1-D tensors (autograd kept) into ``[R, B]`` plus the float mask."""
    length = max(c.numel() for c in columns)
    out_RB = torch.full((length, len(columns)), fill, dtype=torch.float32)
    mask_RB = torch.zeros(length, len(columns))
    for b, c in enumerate(columns):
        out_RB[: c.numel(), b] = c
        mask_RB[: c.numel(), b] = 1.0
    return out_RB, mask_RB


# ---- advantages ---------------------------------------------------------------------------------

def test_group_std_uses_unbiased_std():
    # mean 0.25; deviations 0.75, -0.25 x3; sum of squares 0.75; unbiased var 0.75/3 = 0.25, std 0.5
    # (the population std would be sqrt(0.1875) = 0.433 and give 1.732)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), eps=0.0)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # with the default eps 1e-6: 0.75 / 0.500001, -0.25 / 0.500001
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(adv, torch.tensor([1.499997, -0.499999, -0.499999, -0.499999]),
                               rtol=0, atol=1e-7)


def test_group_std_symmetric_pair():
    # mean 0.5, unbiased std sqrt(1/3) = 0.5773503; 0.5 / (0.5773503 + 1e-6) = 0.8660239
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    torch.testing.assert_close(adv, torch.tensor([0.8660239, -0.8660239, -0.8660239, 0.8660239]))


def test_none_only_centres():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), normalization="none")
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))
    adv = group_advantages(torch.tensor([3.0, 1.0]), normalization="none")
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]))


@pytest.mark.parametrize("normalization", ["group-std", "none"])
@pytest.mark.parametrize("rewards", [[0.7, 0.7, 0.7], [0.1] * 10, [2.0]])
def test_equal_rewards_give_exact_zeros(rewards, normalization):
    adv = group_advantages(torch.tensor(rewards), normalization=normalization)
    assert torch.equal(adv, torch.zeros(len(rewards)))


def test_advantage_stats():
    # mean 0; population std sqrt((2.25 + 3 * 0.25) / 4) = sqrt(0.75) = 0.8660254
    stats = advantage_stats(torch.tensor([1.5, -0.5, -0.5, -0.5]))
    assert stats == pytest.approx({"mean": 0.0, "std": 0.8660254, "min": -0.5, "max": 1.5}, abs=1e-7)
    assert all(type(v) is float for v in stats.values())


# ---- clipped surrogate --------------------------------------------------------------------------

def test_clipped_surrogate_asymmetric_clip():
    # eps_low 0.2 (ratio floor 0.8), eps_high 0.28 (ratio ceiling 1.28); old logp = 0, r = exp(logp)
    # column 0, A = +2: r 1.5  -> high clip, -(1.28 * 2) = -2.56, no grad
    #                   r 1.25 -> inside 1.28 (would clip at a symmetric 0.2), -2.5, grad -A r = -2.5
    #                   r 0.5  -> A > 0 and r low: the unclipped term wins, -1.0, grad -1.0
    # column 1, A = -1: r 0.75 -> low clip, -min(-0.75, -0.8) = 0.8, no grad
    #                   r 1.1  -> inside, 1.1, grad 1.1
    #                   r 1.5  -> A < 0 and r high: the unclipped term wins, 1.5, grad 1.5
    ratios_RB = torch.tensor([[1.5, 0.75], [1.25, 1.1], [0.5, 1.5]])
    logprobs_RB = ratios_RB.log().requires_grad_()
    loss_RB, low_RB, high_RB = clipped_surrogate(logprobs_RB, torch.zeros(3, 2), torch.tensor([2.0, -1.0]),
                                                 clip_eps_low=0.2, clip_eps_high=0.28)
    torch.testing.assert_close(loss_RB, torch.tensor([[-2.56, 0.8], [-2.5, 1.1], [-1.0, 1.5]]))
    assert low_RB.tolist() == [[False, True], [False, False], [False, False]]
    assert high_RB.tolist() == [[True, False], [False, False], [False, False]]
    loss_RB.sum().backward()
    torch.testing.assert_close(logprobs_RB.grad, torch.tensor([[0.0, 0.0], [-2.5, 1.1], [-1.0, 1.5]]))


# ---- KL and entropy -----------------------------------------------------------------------------

def test_kl_k3():
    half, quarter = math.log(0.5), math.log(0.25)
    # d = ref - logp: log 0.5 -> 0.5 + log 2 - 1 = 0.1931472; log 2 -> 2 - log 2 - 1 = 0.3068528; 0 -> 0
    kl = kl_k3(torch.tensor([half, quarter, -1.3]), torch.tensor([quarter, half, -1.3]))
    torch.testing.assert_close(kl, torch.tensor([0.1931472, 0.3068528, 0.0]))
    gen = torch.Generator().manual_seed(0)
    kl = kl_k3(torch.randn(1000, generator=gen) * 3, torch.randn(1000, generator=gen) * 3)
    assert (kl >= 0).all()


def test_entropy_from_logits():
    # p = (0.5, 0.25, 0.25): 0.5 log 2 + 2 * 0.25 log 4 = 1.5 log 2 = 1.0397208 (logits shift-invariant)
    # uniform over 3: log 3 = 1.0986123
    logits_RBV = torch.tensor([[[math.log(0.5) + 3, math.log(0.25) + 3, math.log(0.25) + 3],
                                [7.0, 7.0, 7.0]]])
    torch.testing.assert_close(entropy_from_logits(logits_RBV), torch.tensor([[1.0397208, 1.0986123]]))


# ---- aggregation --------------------------------------------------------------------------------

# ragged micro-batch, lengths 3, 1, 2; padding holds inf and must not leak
INF = float("inf")
PER_TOKEN_RB = torch.tensor([[1.0, 2.0, 3.0], [4.0, INF, 5.0], [6.0, INF, INF]])
MASK_RB = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])


def test_token_aggregation():
    # real tokens sum 1 + 4 + 6 + 2 + 3 + 5 = 21
    assert aggregate(PER_TOKEN_RB, MASK_RB, [0, 1, 2], "token", 6.0).item() == pytest.approx(3.5)
    assert aggregate(PER_TOKEN_RB, MASK_RB, [0, 1, 2], "token", 10.0).item() == pytest.approx(2.1)


def test_sequence_aggregation():
    # sequence means 11/3, 2, 4: sum 29/3
    assert aggregate(PER_TOKEN_RB, MASK_RB, [0, 1, 2], "sequence", 3.0).item() == pytest.approx(29 / 9)
    assert aggregate(PER_TOKEN_RB, MASK_RB, [0, 1, 2], "sequence", 5.0).item() == pytest.approx(29 / 15)


def test_loss_normalizer():
    assert loss_normalizer([3, 1, 2], "token") == 6.0
    assert loss_normalizer([3, 1, 2], "sequence") == 3.0


def _group(seed=0, lengths=(5, 2, 4, 1)):
    gen = torch.Generator().manual_seed(seed)
    new = [(-torch.rand(n, generator=gen) * 3).requires_grad_() for n in lengths]
    old = [n.detach() + torch.randn(n.shape, generator=gen) * 0.3 for n in new]  # some ratios clip
    ref = [n.detach() + torch.randn(n.shape, generator=gen) * 0.3 for n in new]
    entropy = [torch.rand(n, generator=gen).requires_grad_() for n in lengths]
    return new, old, ref, entropy


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_sum_to_one_batch(aggregation):
    """Gradient accumulation: losses (and grads) of micro-batches add up to the one-batch loss."""
    lengths = (5, 2, 4, 1)
    new, old, ref, entropy = _group(lengths=lengths)
    advantages = torch.tensor([1.2, -0.4, 0.3, -1.1])
    kwargs = dict(ref_logprobs=ref, normalizer=loss_normalizer(lengths, aggregation),
                  config=LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05, entropy_coef=0.01,
                                    loss_aggregation=aggregation))

    def run(splits):
        for t in new + entropy:
            t.grad = None
        loss_fn, total = GRPOLoss(old, advantages, **kwargs), 0.0
        for indices in splits:
            logprobs_RB, mask_RB = _pad([new[i] for i in indices])
            entropy_RB, _ = _pad([entropy[i] for i in indices])
            loss = loss_fn(logprobs_RB, mask_RB, indices, entropy_RB)
            loss.backward()
            total += loss.item()
        return total, [t.grad.clone() for t in new + entropy], loss_fn.metrics()

    whole, grads_whole, metrics_whole = run([[0, 1, 2, 3]])
    split, grads_split, metrics_split = run([[0, 1], [2], [3]])
    assert math.isfinite(whole) and whole != 0.0
    assert split == pytest.approx(whole, abs=1e-6)
    for a, b in zip(grads_whole, grads_split):
        torch.testing.assert_close(a, b)
    assert metrics_split == pytest.approx(metrics_whole, abs=1e-6)
    assert metrics_whole["clip_frac_low"] + metrics_whole["clip_frac_high"] > 0


# ---- GRPOLoss -----------------------------------------------------------------------------------

@pytest.mark.parametrize("aggregation, expected", [
    # token: -A / 3 tokens -> sample 0 (A 1.5): -0.5 per token; sample 1 (A -0.5): 1/6
    ("token", ([-0.5, -0.5], [1 / 6])),
    # sequence: -A / (length * 2 sequences) -> -1.5 / 4 = -0.375; 0.5 / 2 = 0.25
    ("sequence", ([-0.375, -0.375], [0.25])),
])
def test_gradient_at_old_policy(aggregation, expected):
    new = [torch.tensor([-0.7, -2.0], requires_grad=True), torch.tensor([-0.1], requires_grad=True)]
    loss_fn = GRPOLoss([t.detach().clone() for t in new], torch.tensor([1.5, -0.5]),
                       config=LossConfig(loss_aggregation=aggregation), normalizer=loss_normalizer([2, 1], aggregation))
    logprobs_RB, mask_RB = _pad(new)
    loss = loss_fn(logprobs_RB, mask_RB, [0, 1])
    loss.backward()
    # at ratio 1 the surrogate value is -A per token: token (-1.5 * 2 + 0.5) / 3; sequence (-1.5 + 0.5) / 2
    assert loss.item() == pytest.approx(-2.5 / 3 if aggregation == "token" else -0.5)
    torch.testing.assert_close(new[0].grad, torch.tensor(expected[0]))
    torch.testing.assert_close(new[1].grad, torch.tensor(expected[1]))
    assert loss_fn.metrics()["ratio_mean"] == pytest.approx(1.0)


def test_gradient_with_kl_and_entropy():
    # ref = logp + log 0.5: d k3 / d logp = 1 - exp(ref - logp) = 0.5; kl_coef 0.1 adds 0.05 per token
    # token normalizer 3: sample 0 (-1.5 + 0.05) / 3 = -0.4833333, sample 1 (0.5 + 0.05) / 3 = 0.1833333
    # entropy bonus 0.01: d loss / d entropy = -0.01 / 3 on real tokens, 0 on padding
    new = [torch.tensor([-0.7, -2.0], requires_grad=True), torch.tensor([-0.1], requires_grad=True)]
    ref = [t.detach() + math.log(0.5) for t in new]
    loss_fn = GRPOLoss([t.detach().clone() for t in new], torch.tensor([1.5, -0.5]), ref_logprobs=ref,
                       config=LossConfig(kl_coef=0.1, entropy_coef=0.01), normalizer=3.0)
    logprobs_RB, mask_RB = _pad(new)
    entropy_RB = torch.full((2, 2), 0.3, requires_grad=True)
    loss_fn(logprobs_RB, mask_RB, [0, 1], entropy_RB).backward()
    torch.testing.assert_close(new[0].grad, torch.tensor([-0.4833333, -0.4833333]))
    torch.testing.assert_close(new[1].grad, torch.tensor([0.1833333]))
    torch.testing.assert_close(entropy_RB.grad, torch.tensor([[-0.01 / 3, -0.01 / 3], [-0.01 / 3, 0.0]]))
    metrics = loss_fn.metrics()
    assert metrics["ref_kl"] == pytest.approx(0.1931472)  # k3 at d = log 0.5, every token
    assert metrics["entropy"] == pytest.approx(0.3)


def test_loss_value_and_metrics_on_ragged_batch():
    # the clipped_surrogate example with sample 1 cut to 2 tokens; its padded row holds ratio 3
    # real tokens 5: loss (-2.56 - 2.5 - 1.0 + 0.8 + 1.1) / 5 = -0.832; one low and one high clip
    # ratio mean (1.5 + 1.25 + 0.5 + 0.75 + 1.1) / 5 = 1.02; approx_kl = mean(r - 1 - log r) = 0.0713821
    old = [torch.log(torch.tensor([0.5, 0.5, 0.5])), torch.log(torch.tensor([0.4, 0.4]))]
    logprobs_RB = torch.log(torch.tensor([[0.5 * 1.5, 0.4 * 0.75],
                                          [0.5 * 1.25, 0.4 * 1.1],
                                          [0.5 * 0.5, 0.9]]))
    mask_RB = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    loss_fn = GRPOLoss(old, torch.tensor([2.0, -1.0]), config=LossConfig(clip_eps_low=0.2, clip_eps_high=0.28),
                       normalizer=5.0)
    assert loss_fn.metrics() == {}
    assert loss_fn(logprobs_RB, mask_RB, [0, 1]).item() == pytest.approx(-0.832, abs=1e-6)
    assert loss_fn.metrics() == pytest.approx({
        "policy_loss": -0.832, "clip_frac_low": 0.2, "clip_frac_high": 0.2, "approx_kl": 0.0713821,
        "ratio_mean": 1.02, "ratio_max": 1.5, "tokens": 5.0}, abs=1e-6)


def test_padding_never_reaches_the_gradient():
    # a padded logprob of 100 would overflow exp() to inf, and 0 * inf = NaN in its backward
    logprobs_RB = torch.tensor([[-0.5, -0.2], [-0.3, 100.0]], requires_grad=True)
    mask_RB = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss_fn = GRPOLoss([torch.tensor([-0.5, -0.3]), torch.tensor([-0.2])], torch.tensor([1.0, -1.0]),
                       ref_logprobs=[torch.tensor([-0.4, -0.4]), torch.tensor([-0.1])],
                       config=LossConfig(kl_coef=0.1), normalizer=3.0)
    loss_fn(logprobs_RB, mask_RB, [0, 1]).backward()
    assert torch.isfinite(logprobs_RB.grad).all() and logprobs_RB.grad[1, 1] == 0.0
    assert loss_fn.metrics()["ratio_max"] == pytest.approx(1.0)


def test_micro_batch_length_mismatch_is_reported():
    loss_fn = GRPOLoss([torch.zeros(3)], torch.tensor([1.0]), normalizer=3.0)
    with pytest.raises(ValueError, match="sample 0: 3 stored log-probs but 2 real tokens"):
        loss_fn(torch.zeros(2, 1), torch.ones(2, 1), [0])


# ---- bad hyper-parameters -----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, flag", [
    (dict(clip_eps_low=-0.1), "--clip-eps-low"),
    (dict(clip_eps_low=1.0), "--clip-eps-low"),
    (dict(clip_eps_low=NAN), "--clip-eps-low"),
    (dict(clip_eps_high=-0.01), "--clip-eps-high"),
    (dict(kl_coef=-1.0), "--kl-coef"),
    (dict(kl_coef=NAN), "--kl-coef"),
    (dict(entropy_coef=-0.001), "--entropy-coef"),
    (dict(loss_aggregation="mean"), "--loss-aggregation"),
])
def test_bad_hyper_parameters_name_the_flag(kwargs, flag):
    """A loss takes its hyper-parameters as a ``LossConfig``, which refuses a bad one on
    construction, naming the flag (the command line's and the code's objects alike)."""
    args = dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, entropy_coef=0.0, loss_aggregation="token")
    args.update(kwargs)
    with pytest.raises(ValueError, match=flag):
        LossConfig(**args)


def test_bad_flags_in_functions():
    with pytest.raises(ValueError, match="--advantage-normalization"):
        group_advantages(torch.tensor([1.0, 0.0]), normalization="std")
    with pytest.raises(ValueError, match="--loss-aggregation"):
        aggregate(PER_TOKEN_RB, MASK_RB, [0, 1, 2], "tokens", 6.0)
    for aggregation in ("tokens", None):  # (None: the flag's unset value, which a loss resolves first)
        with pytest.raises(ValueError, match="--loss-aggregation"):
            aggregate(PER_TOKEN_RB, MASK_RB, [0, 1, 2], aggregation, 6.0)
        with pytest.raises(ValueError, match="--loss-aggregation"):
            loss_normalizer([3, 1, 2], aggregation)
    with pytest.raises(ValueError, match="--clip-eps-high"):
        clipped_surrogate(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), 0.2, -0.2)


def test_coefficients_need_their_inputs():
    with pytest.raises(ValueError, match="--kl-coef 0.1 needs reference log-probs"):
        GRPOLoss([torch.zeros(2)], torch.tensor([1.0]), config=LossConfig(kl_coef=0.1), normalizer=2.0)
    loss_fn = GRPOLoss([torch.zeros(2)], torch.tensor([1.0]), config=LossConfig(entropy_coef=0.01), normalizer=2.0)
    with pytest.raises(ValueError, match="--entropy-coef 0.01 needs the per-token entropy"):
        loss_fn(torch.zeros(2, 1), torch.ones(2, 1), [0])
