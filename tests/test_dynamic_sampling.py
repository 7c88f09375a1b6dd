"""Dynamic sampling (``--dynamic-sampling``): groups of equal rewards dropped and redrawn, the
last draw kept, the metrics, and the flags' bad input. The data-parallel run is in
``test_train_grpo.py``'s two-rank spawn (``test_dynamic_sampling_keeps_data_parallel_ranks_in_step``)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train_grpo
from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.distributed import destroy_distributed, init_distributed
from megatron_longstraw.training import loop
from megatron_longstraw.training.dynamic_sampling import fill_groups, uniform_rewards


@pytest.fixture
def one_process():
    init_distributed(ParallelSizes(), seed=0)
    yield
    destroy_distributed()


def test_uniform_rewards():
    assert uniform_rewards(torch.tensor([0.5, 0.5, 0.5]))
    assert not uniform_rewards(torch.tensor([0.0, 0.0, 1.0]))


def _fake(rewards: list[list[float]]):
    """``draw`` handing out groups with these rewards in turn, and a ``train`` that drops uniform
    ones when asked; ``trained`` records what ``train`` kept."""
    queue = iter(rewards)
    trained = []

    def draw():
        return SimpleNamespace(rewards_G=torch.tensor(next(queue), dtype=torch.float32), responses=[[1]],
                               prompt_ids_S=torch.zeros(5))

    def train(group, drop_uniform):
        if drop_uniform and uniform_rewards(group.rewards_G):
            return None
        trained.append(group.rewards_G.tolist())
        return {"reward/mean": group.rewards_G.mean().item()}

    return draw, train, trained


def test_fill_groups_redraws_uniform_groups_and_keeps_the_last_draw(one_process):
    draw, train, trained = _fake([[0, 1], [1, 1], [0, 0], [1, 0], [1, 1], [1, 1], [0, 0]])
    kept, metrics, spent = fill_groups(draw, train, slots=3, max_draws=3)
    # slot 1: kept at once; slot 2: two dropped, the third kept; slot 3: two dropped, the last draw kept
    assert trained == [[0, 1], [1, 0], [0, 0]] and len(kept) == 3
    assert spent == []  # rewards known at the draw (a rollout file's): dropped before any capture
    assert metrics["dynamic_sampling/skipped_frac"] == pytest.approx(4 / 7)
    assert metrics["dynamic_sampling/draws_per_group"] == pytest.approx(7 / 3)
    assert metrics["reward/drawn_mean"] == pytest.approx((0.5 + 1 + 0 + 0.5 + 1 + 1 + 0) / 7)


def test_without_dynamic_sampling_every_group_trains(one_process):
    draw, train, trained = _fake([[1, 1], [0, 1]])
    kept, metrics, spent = fill_groups(draw, train, slots=2, max_draws=None)
    assert trained == [[1, 1], [0, 1]] and len(kept) == 2 and metrics == {} and spent == []


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--train-iters", "2", "--global-batch-size", "2", "--num-generations", "3",
            "--synthetic-prompt-length", "30", "--prompt-chunk-size", "16", "--max-response-length", "4",
            "--replay-micro-batch-size", "3", "--lr", "1e-2", "--no-save", "--wandb-save-dir", str(tmp_path),
            "--wandb-mode", "offline", "--reward-fn", "reward_fixtures:uniform_on_odd_prompts", *extra]


def test_a_run_drops_the_groups_of_equal_rewards(tmp_path):
    """Odd synthetic prompts earn 0.0 for every response. With two groups a step and at most two
    draws per group, step 1 keeps prompt 0, drops 1 and keeps 2; step 2 drops 3, keeps 4, drops 5
    and keeps 6: 1 of 3 and 2 of 4 draws skipped."""
    args = train_grpo.parse_args(_args(tmp_path, "--dynamic-sampling", "--dynamic-sampling-max-draws", "2"))
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        loop.train(args)
    finally:
        destroy_distributed()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["dynamic_sampling/skipped_frac"] for r in rows] == pytest.approx([1 / 3, 2 / 4])
    assert [r["dynamic_sampling/draws_per_group"] for r in rows] == pytest.approx([1.5, 2.0])
    for row, draws in zip(rows, (3, 4)):  # the dropped groups' rewards are 0: the drawn mean is diluted
        assert row["reward/drawn_mean"] == pytest.approx(row["reward/mean"] * 2 / draws)
        assert row["reward/zero_std_frac"] == 0.0  # only groups with a signal trained
        # the capture's throughput counts the dropped groups' captures, which its time includes
        assert row["throughput/capture_tokens_per_s"] * row["time/capture_s"] == pytest.approx(30 * draws)


@pytest.mark.parametrize("extra,world,needle", [
    (["--dynamic-sampling-max-draws", "0"], 1, "--dynamic-sampling-max-draws must be >= 1, got 0"),
    (["--dynamic-sampling", "--expert-model-parallel-size", "2"], 2,
     "--dynamic-sampling does not run with --expert-model-parallel-size 2"),
])
def test_bad_flags_name_the_flag(tmp_path, extra, world, needle):
    with pytest.raises(ValueError, match=needle):
        train_grpo.parse_args(_args(tmp_path, "--model", "glm-5-debug", *extra), world_size=world)


def test_groups_with_rewards_from_the_file_are_dropped_before_their_capture(tmp_path, monkeypatch):
    """External rollouts whose file gives equal rewards are dropped without a capture: of three
    groups (one with a signal), the step draws until the one with a signal (in the file's seeded
    order) and captures only it."""
    from megatron_longstraw.data.position import EpochOrder
    from megatron_longstraw.training import grpo_step

    rewards = [[1.0, 1.0, 1.0], [0.0, 1.0, 0.5], [0.0, 0.0, 0.0]]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": [5 + i, 9, 7, 3], "responses": [[4, 2], [6], [8, 1]],
                                        "rewards": r}) + "\n" for i, r in enumerate(rewards)))
    captured = []
    real_capture = grpo_step.capture_prompt
    monkeypatch.setattr(grpo_step, "capture_prompt", lambda *a, **k: captured.append(1) or real_capture(*a, **k))
    args = train_grpo.parse_args(_args(tmp_path / "w", "--rollout-source", "jsonl", "--rollout-path", str(path),
                                       "--reward-fn", "exact_match", "--train-iters", "1", "--global-batch-size", "1",
                                       "--dynamic-sampling", "--dynamic-sampling-max-draws", "3"))
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        loop.train(args)
    finally:
        destroy_distributed()
    order = EpochOrder(len(rewards), seed=args.training.seed)
    draws = [order.item_at(0, i) for i in range(3)].index(1) + 1
    assert draws > 1  # the seeded order puts a group of equal rewards first: something is dropped
    (row,) = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert row["dynamic_sampling/draws_per_group"] == draws and captured == [1]
    assert row["dynamic_sampling/skipped_frac"] == pytest.approx((draws - 1) / draws)
