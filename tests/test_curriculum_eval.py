"""The prompt-length curriculum (``--prompt-length-schedule``) and held-out evaluation
(``--eval-interval``): parsing, bad input, and a run that logs both."""

import json
from pathlib import Path

import pytest

import train_grpo
from megatron_longstraw.config.data import PromptLengthSchedule
from megatron_longstraw.distributed import destroy_distributed, init_distributed
from megatron_longstraw.training import loop
from megatron_longstraw.training.startup import resume_path


def test_schedule_stages_by_step():
    schedule = PromptLengthSchedule.parse("512:2, 4096:3,32768")
    assert schedule.stages == ((512, 2), (4096, 3), (32768, None)) and schedule.longest == 32768
    assert [schedule.length_at(i) for i in range(7)] == [512, 512, 4096, 4096, 4096, 32768, 32768]
    assert PromptLengthSchedule.parse("100:5").length_at(9) == 100  # past the stages: the last one's


@pytest.mark.parametrize("text,needle", [("512:x", "stage '512:x' is not LENGTH:STEPS"),
                                         ("512,4096", "only the last stage may leave out its steps ('512')"),
                                         ("0:3,64", "stage '0:3' needs a length and steps >= 1")])
def test_bad_schedules_name_the_flag(text, needle):
    with pytest.raises(ValueError) as err:
        PromptLengthSchedule.parse(text)
    assert str(err.value) == f"--prompt-length-schedule {text!r}: {needle}"


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--train-iters", "4", "--global-batch-size", "1", "--num-generations", "2", "--prompt-chunk-size", "24",
            "--max-response-length", "3", "--lr", "1e-2", "--no-save", "--wandb-save-dir", str(tmp_path / "wandb"),
            "--wandb-mode", "disabled", *extra]


@pytest.mark.parametrize("extra,needle", [
    (["--prompt-length-schedule", "40:2,64", "--data-path", "prompts.jsonl"], "--prompt-length-schedule is for the synthetic task"),
    (["--eval-interval", "-1"], "--eval-interval must be >= 0"),
    (["--eval-interval", "2", "--eval-prompts", "0"], "--eval-prompts 0 must be a positive multiple"),
    (["--eval-interval", "2", "--eval-prompt-lengths", "40,x"], "--eval-prompt-lengths '40,x': comma-separated integers"),
])
def test_bad_flags_are_refused(tmp_path, extra, needle):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    extra = [str(tmp_path / x) if x == "prompts.jsonl" else x for x in extra]
    with pytest.raises(ValueError, match=needle):
        train_grpo.parse_args(_args(tmp_path, *extra))


def test_a_schedule_stage_too_short_for_the_task_is_refused_at_start_up(tmp_path):
    args = train_grpo.parse_args(_args(tmp_path, "--prompt-length-schedule", "6:2,64"))
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        with pytest.raises(ValueError, match="--prompt-length-schedule: synthetic task: prompt_length 6 is too short"):
            loop.train(args)
    finally:
        destroy_distributed()


def test_a_run_follows_its_schedule_and_evaluates_held_out_prompts(tmp_path):
    args = train_grpo.parse_args(_args(tmp_path, "--prompt-length-schedule", "40:2,64", "--eval-interval", "2",
                                       "--eval-prompts", "2", "--eval-prompt-lengths", "40,64",
                                       "--wandb-mode", "offline"))
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        loop.train(args)
    finally:
        destroy_distributed()
    rows = [json.loads(line) for line in (tmp_path / "wandb" / "metrics.jsonl").read_text().splitlines()]
    assert [r["curriculum/prompt_length"] for r in rows] == [40, 40, 64, 64]
    assert [r["prompt/length"] for r in rows] == [40, 40, 64, 64]
    evaluated = [r for r in rows if "eval/greedy_reward" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    for row in evaluated:
        for key in ("eval/len40/greedy_reward", "eval/len40/sampled_reward", "eval/len64/greedy_reward",
                    "eval/len64/sampled_reward"):
            assert 0.0 <= row[key] <= 1.0, (key, row[key])
        assert row["eval/greedy_reward"] == pytest.approx((row["eval/len40/greedy_reward"]
                                                           + row["eval/len64/greedy_reward"]) / 2)
        assert row["time/eval_s"] > 0


def test_the_plan_check_plans_the_longest_prompt_of_the_run(tmp_path):
    from megatron_longstraw.training.plan_check import trainer_prompt_length

    hf = {"max_position_embeddings": 4096}
    args = train_grpo.parse_args(_args(tmp_path, "--prompt-length-schedule", "40:2,64"))
    assert trainer_prompt_length(args, hf) == (64, "--prompt-length-schedule")
    args = train_grpo.parse_args(_args(tmp_path, "--prompt-length-schedule", "40:2,64", "--eval-interval", "2",
                                       "--eval-prompt-lengths", "40,256"))
    assert trainer_prompt_length(args, hf) == (256, "--eval-prompt-lengths")


def test_skip_train_evaluates_a_checkpoint_and_writes_no_metrics_row(tmp_path, capsys):
    """``--skip-train`` on a run's folder: the newest checkpoint evaluated at two lengths, the
    figures printed and written to ``eval_iter_<N>.json``; the run's metrics and checkpoint untouched."""
    argv = [a for a in _args(tmp_path, "--wandb-mode", "offline") if a != "--no-save"]
    argv[argv.index("--train-iters") + 1] = "2"
    argv += ["--save", str(tmp_path / "ckpt")]
    args = train_grpo.parse_args(argv)
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        loop.train(args)
    finally:
        destroy_distributed()
    metrics = (tmp_path / "wandb" / "metrics.jsonl").read_text()
    capsys.readouterr()
    args = train_grpo.parse_args(argv + ["--skip-train", "--eval-prompts", "2", "--eval-prompt-lengths", "40,64"])
    assert resume_path(args) == str(tmp_path / "ckpt")  # the newest checkpoint in --save
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        figures, _ = loop.train(args)
    finally:
        destroy_distributed()
    record = json.loads((tmp_path / "wandb" / "eval_iter_0000002.json").read_text())
    assert record["iteration"] == 2 and record["lengths"] == [40, 64] and record["eval_prompts"] == 2
    for key in ("eval/len40/greedy_reward", "eval/len64/sampled_reward", "eval/greedy_reward"):
        assert 0.0 <= record[key] <= 1.0 and record[key] == figures[key]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    assert (tmp_path / "wandb" / "metrics.jsonl").read_text() == metrics
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_skip_train_needs_a_checkpoint_of_the_synthetic_task(tmp_path):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(ValueError, match="--skip-train evaluates on held-out prompts of the synthetic task"):
        train_grpo.parse_args(_args(tmp_path, "--skip-train", "--data-path", str(tmp_path / "prompts.jsonl")))
    argv = [a for a in _args(tmp_path, "--skip-train") if a != "--no-save"] + ["--save", str(tmp_path / "empty")]
    with pytest.raises(ValueError, match=r"^--skip-train: no checkpoint to evaluate \(give --load, or a --save that"):
        train_grpo.parse_args(argv)
