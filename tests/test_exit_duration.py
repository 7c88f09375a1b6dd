"""``--exit-duration-in-mins``: a run stops after the step that ends past its time, saved, and the
same command resumes it; the metrics continue across the commands."""

import json

import pytest

import train_grpo
from megatron_longstraw.distributed import destroy_distributed, init_distributed
from megatron_longstraw.training import loop


def _train(argv):
    args = train_grpo.parse_args(argv)
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        return loop.train(args)
    finally:
        destroy_distributed()


def test_a_run_out_of_time_saves_and_the_same_command_resumes(tmp_path, capsys):
    argv = ["--train-iters", "2", "--global-batch-size", "1", "--num-generations", "2", "--synthetic-prompt-length",
            "24", "--prompt-chunk-size", "24", "--max-response-length", "2", "--save", str(tmp_path / "ckpt"),
            "--wandb-save-dir", str(tmp_path / "w"), "--wandb-mode", "offline",
            "--exit-duration-in-mins", "1e-9"]  # past after any step
    _train(argv)
    out = capsys.readouterr().out
    assert "stopping at iteration 1 of 2: --exit-duration-in-mins 1e-09 reached; saved iteration 1" in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    _train(argv)  # the same command: resumes at 1, and step 2 is the last one (no stop message)
    out = capsys.readouterr().out
    assert "resuming from" in out and "stopping at" not in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_duration_that_is_not_positive_is_refused(value):
    with pytest.raises(ValueError, match=f"--exit-duration-in-mins must be > 0, got {float(value)}"):
        train_grpo.parse_args(["--exit-duration-in-mins", value, "--no-save", "--wandb-mode", "disabled"])
