"""The GRPO trainer end to end on CPU: internal and external rollouts, wandb offline files,
on-policy consistency, exact resume, atomic saves, and bad input at the command line."""

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import train_grpo
from megatron_longstraw.distributed import destroy_distributed, init_distributed
from megatron_longstraw.testing.multiprocess import run_script
from megatron_longstraw.testing.wandb_records import find_run_file, read_history
from megatron_longstraw.training import loop
from megatron_longstraw.training.startup import model_source

ROOT = Path(__file__).resolve().parents[1]
# Counted as time, throughput, memory or run bookkeeping; everything else must match exactly.
NONDETERMINISTIC = ("time/", "throughput/", "mem/", "mfu/", "_")
REQUIRED = ("reward/mean", "reward/std", "reward/min", "reward/max", "reward/zero_std_frac",
            "advantage/mean", "advantage/std", "loss/policy", "clip/frac_low", "clip/frac_high",
            "kl/approx", "entropy/mean", "response/length_mean", "response/truncation_rate",
            "optim/grad_norm", "optim/lr", "time/capture_s", "time/rollout_s", "time/scoring_s",
            "time/replay_s", "time/optimizer_s", "throughput/capture_tokens_per_s",
            "throughput/replay_tokens_per_s", "prompt/length", "prompt/state_bytes")


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--train-iters", "4", "--global-batch-size", "2", "--num-generations", "3",
            "--synthetic-prompt-length", "48", "--prompt-chunk-size", "20", "--max-response-length", "5",
            "--replay-micro-batch-size", "2", "--lr", "1e-2", "--save", str(tmp_path / "ckpt"),
            "--wandb-save-dir", str(tmp_path / "wandb"), "--wandb-mode", "offline",
            "--reward-fn", "reward_fixtures:low_token_fraction", *extra]


def _train(argv):
    args = train_grpo.parse_args(argv)
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        metrics, model = loop.train(args)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        destroy_distributed()
    return metrics, params


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NONDETERMINISTIC)}


def test_internal_rollouts_train_log_to_wandb_and_stay_on_policy(tmp_path):
    _, params = _train(_args(tmp_path, "--entropy-coef", "0.01", "--kl-coef", "0.05"))
    history = read_history(find_run_file(tmp_path / "wandb"))
    assert [row["_step"] for row in history] == [1, 2, 3, 4]
    missing = [k for k in REQUIRED + ("kl/reference",) if k not in history[-1]]
    assert not missing, missing
    for row in history:  # old log-probs are scored exactly as the replay computes them
        assert row["ratio/max"] == 1.0 and row["kl/approx"] == 0.0
        assert row["optim/grad_norm"] > 0
        # the decoder's own log-probs against replay's: a gap of kernel rounding only
        assert 0 <= row["rollout/logprob_diff_max"] < 1e-4 and row["rollout/weight_mean"] == 1.0
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert all(torch.isfinite(p).all() for p in params.values())
    # the trained weights leave as an HF checkpoint (tools/convert_checkpoint.py reads trainer saves)
    sys.path.insert(0, str(ROOT / "tools"))
    import convert_checkpoint
    from megatron_longstraw.models.presets import resolve_hf_config
    from megatron_longstraw.models.qwen3_5.convert import WEIGHTS
    from safetensors.torch import load_file

    assert convert_checkpoint.main(["mcore-to-hf", "--load", str(tmp_path / "ckpt"), "--save",
                                    str(tmp_path / "hf"), "--no-progress"]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    expected = WEIGHTS.mcore_to_hf(params, resolve_hf_config("qwen3.5-debug"), checkpoint_layout=True)
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name


def test_resume_gives_identical_parameters_and_metrics(tmp_path, capsys):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    schedule = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--lr-decay-iters", "4",
                "--min-lr", "1e-3", "--kl-coef", "0.05", "--entropy-coef", "0.01"]
    _, params_straight = _train(_args(straight, *schedule))
    _train(_args(resumed, "--train-iters", "2", *schedule))
    capsys.readouterr()
    _, params_resumed = _train(_args(resumed, "--load", str(resumed / "ckpt"), *schedule))
    # the console: the load and the save with their folders and seconds, each step as k/N with an ETA
    out = capsys.readouterr().out.splitlines()
    loaded = re.escape(str(resumed / "ckpt" / "iter_0000002"))
    assert any(re.fullmatch(rf"resuming from {loaded} at iteration 2.*, loaded in \d+\.\d s", line) for line in out), out
    saved = re.escape(str(resumed / "ckpt" / "iter_0000004"))
    assert any(re.fullmatch(rf"saved checkpoint iteration 4 to {saved} \(\d+\.\d s\)", line) for line in out), out
    steps = [line for line in out if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == ["step 3/4", "step 4/4"], steps
    assert all(re.match(r"step \d/4 \| ETA \d+:\d\d:\d\d \| reward/mean ", line) for line in steps), steps
    assert steps[-1].split(" | ")[1] == "ETA 0:00:00"
    for name, value in params_straight.items():
        assert torch.equal(value, params_resumed[name]), name
    rows_straight, rows_resumed = _rows(straight / "wandb"), _rows(resumed / "wandb")
    assert [r["step"] for r in rows_resumed] == [1, 2, 3, 4]
    for a, b in zip(rows_straight, rows_resumed):
        assert _deterministic(a) == _deterministic(b)
    assert len({r["optim/lr"] for r in rows_straight}) == 4  # the schedule moves every step
    # the step that saved has its save's seconds (at the end; the resumed run's first part at 2)
    assert [r.get("time/save_s", 0) > 0 for r in rows_straight] == [False, False, False, True]
    assert [r.get("time/save_s", 0) > 0 for r in rows_resumed] == [False, True, False, True]
    history = read_history(find_run_file(resumed / "wandb"))  # the resumed run continues the wandb run
    assert [row["_step"] for row in history][-2:] == [3, 4]


def test_external_rollouts_train_end_to_end(tmp_path):
    gen = torch.Generator().manual_seed(0)
    lines = []
    for i in range(3):
        prompt = torch.randint(0, 200, (30 + i,), generator=gen).tolist()
        responses = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (3, 5, 4)]
        line = {"prompt_ids": prompt, "responses": responses}
        if i != 1:
            line["rewards"] = [0.0, 1.0, 0.5]
        else:
            line["answer"] = responses[0]
        lines.append(json.dumps(line))
    path = tmp_path / "rollouts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    metrics, _ = _train(_args(tmp_path, "--rollout-source", "jsonl", "--rollout-path", str(path),
                              "--reward-fn", "exact_match", "--train-iters", "2"))
    rows = _rows(tmp_path / "wandb")
    assert len(rows) == 2 and all(r["ratio/max"] == 1.0 for r in rows)
    assert metrics["reward/max"] == 1.0


def _cli(*argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}  # reward_fixtures
    return run_script(ROOT / "train_grpo.py", list(argv), cwd=ROOT, env=env)


@pytest.mark.parametrize("argv,needle", [
    (["--tensor-model-parallel-size", "3"], "world size 1 is not divisible"),
    (["--reward-fn", "reward_fixtures:raises"], "reward backend is down"),
])
def test_bad_input_at_the_command_line_is_one_line_and_nonzero(tmp_path, argv, needle):
    result = _cli(*_args(tmp_path), *argv)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and needle in last, result.stderr[-2000:]
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt"),
    (["--global-batch-size", "0"], "--global-batch-size"),
    (["--synthetic-prompt-length", "100000"], "--synthetic-prompt-length 100000"),
    (["--reward-fn", "no_such_module_xyz:fn"], "--reward-fn"),
    (["--clip-eps-low", "1.5"], "--clip-eps-low"),
    (["--reward-fn", "reward_fixtures:nan"], "reward_fixtures:nan"),
    (["--rollout-source", "jsonl"], "--rollout-path"),
    (["--num-generations", "1"], "--num-generations must be >= 2, got 1: advantages are group-relative"),
])
def test_bad_input_raises_value_error_naming_the_flag(tmp_path, argv, needle):
    with pytest.raises(ValueError) as err:
        _train(_args(tmp_path, *argv))
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


def test_a_broken_reward_fails_at_start_up(tmp_path, monkeypatch):
    """--reward-fn is called once at start-up on the first record: a reward that raises fails
    before any prompt group is trained, in one line naming the flag, the record and the error."""
    def no_group(*args, **kwargs):
        raise AssertionError("a prompt group was trained before the reward was checked")

    monkeypatch.setattr(loop, "train_group", no_group)
    with pytest.raises(ValueError) as err:
        _train(_args(tmp_path, "--train-iters", "1", "--reward-fn", "reward_fixtures:raises"))
    message = str(err.value)
    assert "(--reward-fn)" in message and "synthetic:0 (start-up check)" in message, message
    assert "RuntimeError: reward backend is down" in message and "\n" not in message, message


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    _train(_args(tmp_path, "--train-iters", "2"))
    real_save = dist_checkpointing.save

    def crash(state, folder, *a, **k):
        real_save(state, folder, *a, **k)
        raise RuntimeError("simulated crash after writing the shards")

    monkeypatch.setattr(dist_checkpointing, "save", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _train(_args(tmp_path, "--train-iters", "3", "--load", str(tmp_path / "ckpt")))
    monkeypatch.setattr(dist_checkpointing, "save", real_save)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (tmp_path / "ckpt" / "iter_0000003").exists()
    _train(_args(tmp_path, "--train-iters", "3", "--load", str(tmp_path / "ckpt")))
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    # step 3 was logged before its save crashed; the resume from step 2 logs it once
    assert [r["step"] for r in _rows(tmp_path / "wandb")] == [1, 2, 3]


def _files(folder: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_a_relaunch_resumes_and_a_fresh_start_loses_nothing(tmp_path, capsys):
    """A relaunch into the same --save resumes from its checkpoint (--load defaults to --save),
    appending to metrics.jsonl after dropping its truncated last line (a crash mid-write) with a
    warning; a malformed line elsewhere is an error naming the file and line. Starting fresh there
    is refused without --overwrite; with it, a run that fails in step 1 leaves the earlier run's
    checkpoint and metrics as they were. A run whose checkpoint is at --train-iters touches nothing."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "wandb" / "metrics.jsonl"
    _train(_args(tmp_path, "--train-iters", "1"))
    for argv, needles in [(["--no-load"], (f"--save {ckpt}", "iteration 1", "--no-load", "--overwrite")),
                          (["--no-save"], (str(metrics), "--no-save", "--overwrite"))]:
        with pytest.raises(ValueError) as err:
            train_grpo.parse_args(_args(tmp_path, *argv))
        assert all(n in str(err.value) for n in needles) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="reward backend is down"):
        _train(_args(tmp_path, "--no-load", "--overwrite", "--reward-fn", "reward_fixtures:raises"))
    assert [r["step"] for r in _rows(tmp_path / "wandb")] == [1]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not list(metrics.parent.glob("metrics.jsonl.*"))
    metrics.write_text(metrics.read_text() + '{"step": 2, "reward/me')
    capsys.readouterr()
    _train(_args(tmp_path, "--train-iters", "2"))
    out = capsys.readouterr()
    assert f"resuming from {ckpt / 'iter_0000001'} at iteration 1" in out.out, out.out
    assert f"warning: {metrics}: dropped its truncated last line 2" in out.err, out.err
    assert [r["step"] for r in _rows(tmp_path / "wandb")] == [1, 2]
    before = _files(tmp_path)
    train_grpo.main(_args(tmp_path, "--train-iters", "2"))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("nothing to do:") and "iteration 2" in last, last
    assert _files(tmp_path) == before
    metrics.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=f"^{metrics} line 2: "):
        _train(_args(tmp_path, "--train-iters", "3"))


def test_a_fresh_overwrite_run_that_crashes_before_saving_resumes_neither_run(tmp_path, monkeypatch):
    """--no-load --overwrite over a finished run, killed in its first save: the earlier run's tracker
    is set aside once the fresh run's first step is done, so a plain relaunch is refused (naming
    the checkpoints) instead of resuming the earlier run into the fresh run's metrics; the earlier
    run's checkpoint and metrics are kept."""
    ckpt, wandb_dir = tmp_path / "ckpt", tmp_path / "wandb"
    _train(_args(tmp_path, "--train-iters", "2"))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(loop, "save_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        _train(_args(tmp_path, "--train-iters", "1", "--no-load", "--overwrite"))
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()
    assert (ckpt / "latest_checkpointed_iteration.txt.earlier").read_text().strip() == "2"
    assert (ckpt / "iter_0000002").is_dir()
    assert [r["step"] for r in _rows(wandb_dir)] == [1]  # the fresh run's
    assert [json.loads(line)["step"] for line in (wandb_dir / "metrics.jsonl.1").read_text().splitlines()] == [1, 2]
    with pytest.raises(ValueError, match="holds checkpoints .*iter_0000002.* but no latest_checkpointed_iteration"):
        train_grpo.parse_args(_args(tmp_path, "--train-iters", "3"))


def _run_in_own_folder(folders):
    """A rank of ``test_ranks_that_see_different_checkpoints_refuse_to_start``: the trainer with
    its own --save; the one-line error it raises, if any."""
    from megatron_longstraw.testing.trainer_runs import train_worker

    try:
        train_worker(_args(folders[int(os.environ["RANK"])], "--train-iters", "2", "--wandb-mode", "disabled"))
    except ValueError as err:
        return str(err)
    return None


def test_ranks_that_see_different_checkpoints_refuse_to_start(tmp_path):
    """Each rank decides from the files of --save whether to resume: two ranks that see different
    files (one a checkpoint at iteration 1, one none) both stop with one error, before training."""
    from megatron_longstraw.testing.multiprocess import run_multiprocess

    _train(_args(tmp_path / "a", "--train-iters", "1", "--wandb-mode", "disabled"))
    errors = run_multiprocess(_run_in_own_folder, 2, [tmp_path / "a", tmp_path / "b"])
    assert all(e is not None and "ranks disagree on the iteration to resume from (from 0 to 1)" in e for e in errors), errors
    assert not (tmp_path / "b" / "ckpt").exists()


def test_resuming_an_older_checkpoint_keeps_the_rows_it_redoes(tmp_path, capsys):
    """An explicit --load of an older checkpoint into a run folder with later rows: the rows it
    redoes are written again, and the file as it was is kept as metrics.jsonl.1. A checkpoint
    whose own step has no row (a run stopped between the save and the row) is said in a warning."""
    _train(_args(tmp_path, "--train-iters", "2", "--save-interval", "1"))
    _train(_args(tmp_path, "--train-iters", "2", "--load", str(tmp_path / "ckpt" / "iter_0000001")))
    assert [r["step"] for r in _rows(tmp_path / "wandb")] == [1, 2]
    kept = (tmp_path / "wandb" / "metrics.jsonl.1").read_text().splitlines()
    assert [json.loads(line)["step"] for line in kept] == [1, 2]
    metrics = tmp_path / "wandb" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().splitlines(keepends=True)[0])  # step 2's row lost
    capsys.readouterr()
    _train(_args(tmp_path, "--train-iters", "3"))
    assert f"warning: {metrics} has no row of step 2, the checkpoint's" in capsys.readouterr().err
    assert [r["step"] for r in _rows(tmp_path / "wandb")] == [1, 3]


# what the libraries print at start-up and at the first save unless the trainer filters it
LIBRARY_NOTICE = re.compile(r"warn|deprecat|experimental|not installed|not supported|^[DIWE]\d{4} ", re.IGNORECASE)


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    from megatron_longstraw.console import optional_line

    saved = _cli(*_args(tmp_path, "--train-iters", "1"))  # the checkpoint, and the console of a run
    assert saved.returncode == 0, saved.stderr[-2000:]
    out, err = saved.stdout.splitlines(), saved.stderr.splitlines()
    notices = [line for line in out[:20] + err[:20] if LIBRARY_NOTICE.search(line) and not line.startswith("optional: ")]
    assert not notices, notices
    assert optional_line() is None or optional_line() in out[:3], out[:3]  # what is absent, in one line
    assert out[-2].startswith("saved checkpoint iteration 1 to ") and out[-1].startswith("step 1/1 | ETA 0:00:00 |"), out
    for shard in (tmp_path / "ckpt" / "iter_0000001").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    # in this process (the command line's "error: ..." of a ValueError: test_bad_input_at_the_command_line)
    with pytest.raises(ValueError) as err:
        _train(_args(tmp_path, "--train-iters", "2", "--load", str(tmp_path / "ckpt")))
    last = str(err.value)
    assert "\n" not in last and last.startswith("--load") and "corrupt" in last, last
    assert "__0_0.distcp is truncated (100 bytes" in last, last  # names the file


def _converted_checkpoint(folder: Path, preset: str, **changes) -> Path:
    """A preset (with ``changes``) as a tiny random HF model converted by tools/convert_checkpoint.py
    (``folder/mcore``, its HF config in ``hf_config.json``)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import convert_checkpoint

    from megatron_longstraw.models.presets import resolve_hf_config
    from megatron_longstraw.testing.hf_reference import build_hf_model

    hf = {**resolve_hf_config(preset), **changes}
    hf.pop("_source", None)
    build_hf_model(hf, seed=3).save_pretrained(folder / "hf")
    assert convert_checkpoint.main(["hf-to-mcore", "--load", str(folder / "hf"), "--save", str(folder / "mcore"),
                                    "--no-progress"]) == 0
    return folder / "mcore"


ROPE_THETA = 10_000  # qwen3.5-debug's is 1e7
ONE_QUICK_STEP = ("--train-iters", "1", "--wandb-mode", "disabled", "--global-batch-size", "1", "--num-generations",
                  "2", "--synthetic-prompt-length", "24", "--prompt-chunk-size", "24", "--max-response-length", "2")


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    """A converted qwen3.5-debug of another rope_theta, one step trained from it with
    --pretrained-checkpoint alone, and that run's checkpoint:
    ``(converted folder, run folder, the trained model's RoPE inverse frequencies, its parameters)``."""
    tmp = tmp_path_factory.mktemp("warm_start")
    rope = dict(rope_type="default", rope_theta=ROPE_THETA, partial_rotary_factor=0.25)
    converted = _converted_checkpoint(tmp, "qwen3.5-debug", rope_parameters=rope)
    args = train_grpo.parse_args(_args(tmp / "run", *ONE_QUICK_STEP, "--pretrained-checkpoint", str(converted)))
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        _, model = loop.train(args)
        inv_freq = model.rotary_pos_emb.inv_freq.detach().clone()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        destroy_distributed()
    return converted, tmp / "run", inv_freq, params


def test_pretrained_checkpoint_gives_the_model_config(warm_start):
    from megatron_longstraw.models.hf_config import rope_parameters

    _, run, inv_freq, _ = warm_start
    rotary_dim = 16 // 4  # head_dim x partial_rotary_factor
    expected = 1.0 / ROPE_THETA ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    torch.testing.assert_close(inv_freq.double(), expected)
    saved = json.loads((run / "ckpt" / "iter_0000001" / "hf_config.json").read_text())
    assert rope_parameters(saved)["rope_theta"] == ROPE_THETA


def test_pretrained_checkpoint_takes_a_trainer_save(warm_start, tmp_path):
    """A run's own checkpoint (a warm start's, say) as --pretrained-checkpoint: its weights only,
    exactly (here kept by a zero learning rate), a fresh run from step 1 (no optimizer state,
    no iteration count taken over)."""
    _, run, _, trained = warm_start
    metrics, params = _train(_args(tmp_path / "next", *ONE_QUICK_STEP, "--no-save", "--lr", "0",
                                   "--pretrained-checkpoint", str(run / "ckpt")))
    assert params.keys() == trained.keys()
    assert all(torch.equal(params[name], trained[name]) for name in trained)
    assert [row["step"] for row in _rows(tmp_path / "next" / "wandb")] == [1]


def test_model_flag_takes_a_converted_checkpoint(warm_start, tmp_path):
    converted, _, _, _ = warm_start
    _, params = _train(_args(tmp_path / "config", *ONE_QUICK_STEP, "--no-save", "--model", str(converted)))
    assert params["decoder.layers.0.mlp.linear_fc1.weight"].shape == (256, 64)
    args = train_grpo.parse_args(_args(tmp_path / "both", "--model", str(converted),
                                       "--pretrained-checkpoint", str(converted)))
    assert model_source(args) == str(converted)  # the same model: accepted


@pytest.mark.parametrize("flag", ["--model", "--hf-config"])
def test_another_model_than_the_pretrained_checkpoint_is_refused(warm_start, tmp_path, flag):
    converted, _, _, _ = warm_start
    other = {**json.loads((converted / "hf_config.json").read_text()), "intermediate_size": 96}
    (tmp_path / "other.json").write_text(json.dumps(other))
    given = "qwen3.5-debug" if flag == "--model" else str(tmp_path / "other.json")
    with pytest.raises(ValueError) as err:
        train_grpo.parse_args(_args(tmp_path, flag, given, "--pretrained-checkpoint", str(converted)))
    message = str(err.value)
    assert message.startswith(f"{flag} {given} is another model than --pretrained-checkpoint {converted}")
    needle = "rope_theta 10000000 vs 10000" if flag == "--model" else "intermediate_size 96 vs 128"
    assert needle in message and "\n" not in message, message


def test_loading_a_checkpoint_of_another_model_names_the_tensor(warm_start, tmp_path):
    _, run, _, _ = warm_start
    other = {**json.loads((run / "ckpt" / "iter_0000001" / "hf_config.json").read_text()), "intermediate_size": 96}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError) as err:
        _train(_args(tmp_path, *ONE_QUICK_STEP, "--train-iters", "2", "--load", str(run / "ckpt"),
                     "--model", str(tmp_path / "other.json")))
    message = str(err.value)
    assert "a checkpoint of another model: tensor 'decoder.layers.0.mlp.linear_fc1.weight' has shape " \
           "(256, 64) in the checkpoint and (192, 64) in this model" in message and "\n" not in message, message


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_damaged_pretrained_checkpoint_names_the_file(warm_start, tmp_path, damage):
    converted, _, _, _ = warm_start
    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)  # (with the HF assets it keeps in a subfolder)
    data = broken / "__0_0.distcp"
    if damage == "missing":
        data.unlink()
    else:
        data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(ValueError) as err:
        _train(_args(tmp_path, *ONE_QUICK_STEP, "--no-save", "--pretrained-checkpoint", str(broken)))
    message = str(err.value)
    assert message.startswith(f"--pretrained-checkpoint {broken}: checkpoint is corrupt or incomplete: "
                              f"__0_0.distcp is {damage}") and "\n" not in message, message


def _rollout_file(tmp_path: Path) -> Path:
    gen = torch.Generator().manual_seed(1)
    lines = []
    for i in range(2):
        prompt = torch.randint(0, 200, (25 + 7 * i,), generator=gen).tolist()
        responses = [torch.randint(0, 200, (n + 2 * i,), generator=gen).tolist() for n in (3, 6, 4)]
        lines.append(json.dumps({"prompt_ids": prompt, "responses": responses, "rewards": [0.0, 1.0, 0.25 * i]}))
    path = tmp_path / "rollouts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _tp_cp_config(folder: Path) -> Path:
    """qwen3.5-debug with 4 Gated DeltaNet key heads (Megatron wants them divisible by TP x CP)."""
    from megatron_longstraw.models.presets import resolve_hf_config

    config = {**resolve_hf_config("qwen3.5-debug"), "linear_num_key_heads": 4, "linear_num_value_heads": 4}
    config.pop("_source")
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


AGGREGATIONS = ("token", "sequence")


def _glm_checkpoint(folder: Path) -> Path:
    """glm-5-debug from a tiny random HF model through tools/convert_checkpoint.py: the same
    initial weights under any layout (random initialization depends on the expert layout)."""
    return _converted_checkpoint(folder, "glm-5-debug")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Every multi-process trainer run of this module, in three spawns: two ranks (DP=2, CP=2,
    PP=2, EP=2 x DP=2), four ranks (TP=2 x CP=2), then one rank (the one-process references and
    the resumes from the multi-rank checkpoints); each run on a store port of its own
    (``trainer_runs.train_workers``). ``{name: [result per rank]}``."""
    from megatron_longstraw.testing.multiprocess import run_multiprocess
    from megatron_longstraw.testing.trainer_runs import train_workers

    tmp = tmp_path_factory.mktemp("spawned")
    rollouts = str(_rollout_file(tmp))
    quiet = ["--wandb-mode", "disabled"]  # metrics.jsonl: one folder per run (below)
    external = ["--rollout-source", "jsonl", "--rollout-path", rollouts, "--reward-fn", "exact_match"]
    internal = ["--synthetic-prompt-length", "37", "--max-response-length", "5", "--lr", "1e-2",
                "--reward-fn", "reward_fixtures:low_token_fraction"]
    one_step = ["--train-iters", "1", "--num-generations", "3", "--no-save", *quiet, "--prompt-chunk-size", "16",
                "--replay-micro-batch-size", "2"]
    dp = {f"dp-{a}": one_step + ["--global-batch-size", "2", *external, "--loss-aggregation", a] for a in AGGREGATIONS}
    cp = {"cp-external": one_step + ["--global-batch-size", "2", *external],
          "cp-internal": one_step + ["--global-batch-size", "1", *internal]}
    pp = ["--global-batch-size", "1", "--num-generations", "3", "--synthetic-prompt-length", "37",
          "--prompt-chunk-size", "16", "--max-response-length", "5", "--replay-micro-batch-size", "2",
          "--lr", "1e-2", "--entropy-coef", "0.01", *quiet, "--reward-fn", "reward_fixtures:low_token_fraction"]
    # step 3 with --prompt-gradient exact from the PP=2 run's step-2 checkpoint (as pp-at-1 takes it detached)
    pp_exact = ["--train-iters", "3", "--load", str(tmp / "pp" / "iter_0000002"), "--no-save",
                "--prompt-gradient", "exact"]
    tp_cp = ["--model", str(_tp_cp_config(tmp)), "--global-batch-size", "1", "--num-generations", "3", *quiet,
             *external, "--prompt-chunk-size", "16", "--replay-micro-batch-size", "2", "--lr", "1e-2"]
    layout = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
    # GLM-5 with its experts over the two data-parallel ranks: prompts of 25 and 32 tokens are 3
    # and 4 capture chunks of 10 (expert_lockstep)
    glm = ["--model", "glm-5-debug", "--pretrained-checkpoint", str(_glm_checkpoint(tmp))]
    ep_dp = one_step + glm + ["--global-batch-size", "2", *external, "--prompt-chunk-size", "10"]
    # GLM-5 sampling its responses from the CP-sharded latents and indexer keys, two steps (the
    # second decodes from the updated weights; at this learning rate its rewards still differ):
    # shards 8|8, 8|8, 3|2 of the 37-token prompt
    glm_cp = one_step + glm + ["--global-batch-size", "1", *internal, "--train-iters", "2", "--lr", "1e-3"]
    # dynamic sampling over DP=2: rank 1 gets the odd prompts, whose rewards are all 0.0 (dropped)
    dynamic = ["--train-iters", "1", "--global-batch-size", "2", "--num-generations", "3", "--no-save", *quiet,
               "--synthetic-prompt-length", "30", "--prompt-chunk-size", "16", "--max-response-length", "4",
               "--replay-micro-batch-size", "3", "--lr", "1e-2", "--reward-fn", "reward_fixtures:uniform_on_odd_prompts",
               "--dynamic-sampling", "--dynamic-sampling-max-draws", "2"]
    spawns = [
        (2, {**dp, **{name: argv + ["--context-parallel-size", "2"] for name, argv in cp.items()},
             "pp2": pp + ["--pipeline-model-parallel-size", "2", "--train-iters", "3", "--save", str(tmp / "pp"),
                          "--save-interval", "2"],
             "pp2-vpp2": pp + ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                               "--train-iters", "3", "--save", str(tmp / "vpp"), "--save-interval", "2"],
             "pp2-exact": pp + ["--pipeline-model-parallel-size", "2", *pp_exact],
             "ep-dp": ep_dp + ["--expert-model-parallel-size", "2"],
             "glm-cp-internal": glm_cp + ["--context-parallel-size", "2"],
             "dp-dynamic": dynamic, "cp-dynamic": dynamic + ["--context-parallel-size", "2"]}),
        (4, {"tp-cp-save": tp_cp + layout + ["--train-iters", "2", "--save", str(tmp / "tp-cp")],
             "tp-cp-resumed": tp_cp + layout + ["--train-iters", "3", "--load", str(tmp / "tp-cp"), "--no-save"]}),
        (1, {**{f"{name}-single": argv for name, argv in {**dp, **cp}.items()},
             "tp-cp-at-1": tp_cp + ["--train-iters", "3", "--load", str(tmp / "tp-cp"), "--no-save"],
             "pp-at-1": pp + ["--train-iters", "3", "--load", str(tmp / "pp" / "iter_0000002"), "--no-save"],
             "vpp-at-1": pp + ["--train-iters", "3", "--load", str(tmp / "vpp" / "iter_0000002"), "--no-save"],
             "pp-exact-at-1": pp + pp_exact,
             "ep-dp-single": ep_dp,
             "glm-cp-internal-single": glm_cp}),
    ]
    out = {}
    for world, runs in spawns:  # each run logs into a folder of its own (a fresh run refuses another's)
        argvs = [argv + ["--wandb-save-dir", str(tmp / "w" / name)] for name, argv in runs.items()]
        ranks = run_multiprocess(train_workers, world, argvs)
        out.update({name: [rank[i] for rank in ranks] for i, name in enumerate(runs)})
    return out, Path(rollouts)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_data_parallel_step_equals_one_process_on_the_same_global_batch(spawned, aggregation):
    """DP=2 (one group per rank, DDP averaging) vs one process with both groups, for token and
    sequence aggregation: the same loss and gradient norm, hence the same normalization (groups
    of different lengths)."""
    from megatron_longstraw.grpo.advantages import group_advantages

    runs, path = spawned
    (single,), pair = runs[f"dp-{aggregation}-single"], runs[f"dp-{aggregation}"]
    for key in ("loss/total", "optim/grad_norm", "tokens/response", "reward/mean", "reward/max"):
        a, b = single["metrics"][key], pair[0]["metrics"][key]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (aggregation, key, a, b)
    assert pair[0]["metrics"]["optim/grad_norm"] > 0
    # at ratio 1 each token's surrogate is -A: the step loss is exactly the global token (or
    # sequence) mean of -A, whatever the group lengths
    terms, weights = [], []
    for line in path.read_text().splitlines():
        group = json.loads(line)
        advantages = group_advantages(torch.tensor(group["rewards"]), "group-std")
        for a, response in zip(advantages.tolist(), group["responses"]):
            n = len(response) if aggregation == "token" else 1
            terms.append(-a * n)
            weights.append(n)
    expected = sum(terms) / sum(weights)
    assert abs(single["metrics"]["loss/total"] - expected) <= 1e-6, (aggregation, single["metrics"]["loss/total"])
    for name, value in pair[0]["params"].items():
        assert (value == pair[1]["params"][name]).all(), name  # ranks stay in sync


def test_dynamic_sampling_keeps_data_parallel_ranks_in_step(spawned):
    """DP=2 with dynamic sampling, at most two draws per group: each draw round hands rank 0 an
    even prompt (kept at once) and rank 1 an odd one (equal rewards). Rank 1 drops prompt 1 and
    trains its last draw, prompt 3, whatever its rewards; rank 0 draws prompt 2 along and leaves
    it. The step has 3 draws, 1 dropped, one trained group of zero variance, and the ranks end equal."""
    runs, _ = spawned
    pair = runs["dp-dynamic"]
    for run in pair:
        metrics = run["metrics"]
        assert metrics["dynamic_sampling/skipped_frac"] == pytest.approx(1 / 3)
        assert metrics["dynamic_sampling/draws_per_group"] == pytest.approx(1.5)
        assert metrics["reward/zero_std_frac"] == pytest.approx(0.5)
        assert metrics["optim/grad_norm"] > 0
    for name, value in pair[0]["params"].items():
        assert (value == pair[1]["params"][name]).all(), name


def test_dynamic_sampling_drops_a_group_on_both_context_parallel_ranks(spawned):
    """CP=2 (both ranks hold every group: they drop or keep it together, ``agree_uniform`` over
    the context-parallel group): the single process's draws, keeping prompt 0, dropping 1 and
    training 2 (1 of 3 draws skipped), and both ranks end equal."""
    runs, _ = spawned
    pair = runs["cp-dynamic"]
    for run in pair:
        assert run["metrics"]["dynamic_sampling/skipped_frac"] == pytest.approx(1 / 3)
        assert run["metrics"]["dynamic_sampling/draws_per_group"] == pytest.approx(1.5)
        assert run["metrics"]["reward/zero_std_frac"] == 0.0
    for name, value in pair[0]["params"].items():
        assert (value == pair[1]["params"][name]).all(), name


def test_expert_parallel_over_data_ranks_step_equals_one_process(spawned):
    """GLM-5, EP=2 over DP=2 (each rank its own prompt, of 3 and 4 capture chunks; the experts
    split over the ranks) vs one process with both groups, from the same converted checkpoint:
    the same loss, gradient norm and updated weights (dense ones on both ranks, each expert on
    its owner)."""
    runs, _ = spawned
    (single,), pair = runs["ep-dp-single"], runs["ep-dp"]
    for key in ("loss/total", "optim/grad_norm", "entropy/mean", "tokens/response"):
        a, b = single["metrics"][key], pair[0]["metrics"][key]
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (key, a, b)
    assert single["metrics"]["optim/grad_norm"] > 0
    from megatron_longstraw.models.builder import expert_global_name
    from megatron_longstraw.models.presets import resolve_hf_config

    per_rank = resolve_hf_config("glm-5-debug")["n_routed_experts"] // len(pair)
    seen = set()
    for rank, result in enumerate(pair):
        for name, value in result["params"].items():
            name = expert_global_name(name, rank * per_rank)
            seen.add(name)
            # Adam's first step is about lr x sign(g) (lr 1e-3): on entries whose gradient is near
            # zero, fp32 summation order moves it by up to ~1e-6 (measured 1.6e-6); 1% of a step
            assert abs(value - single["params"][name]).max() <= 1e-5, (rank, name)
    assert seen == set(single["params"])


def test_context_parallel_step_equals_one_process(spawned):
    """CP=2 (prompt state sharded over 2 ranks, response replicated, DDP over DP x CP) vs CP=1:
    the same loss and gradient norm, and both CP ranks end with the same parameters."""
    runs, _ = spawned
    (single,), pair = runs["cp-external-single"], runs["cp-external"]
    for key in ("loss/total", "optim/grad_norm", "tokens/response", "prompt/state_bytes"):
        a, b = single["metrics"][key], pair[0]["metrics"][key]
        if key == "prompt/state_bytes":
            assert b < a  # each CP rank keeps only its shard of the pages
            continue
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (key, a, b)
    for name, value in pair[0]["params"].items():
        assert (value == pair[1]["params"][name]).all(), name


def test_context_parallel_internal_rollouts_step_equals_one_process(spawned):
    """Internal rollouts under CP=2 (decoding from the CP-sharded prompt state, tokens replicated
    over the CP ranks) vs CP=1: the same rewards, loss and gradient norm after one step, and both
    CP ranks end with the same parameters."""
    runs, _ = spawned
    (single,), pair = runs["cp-internal-single"], runs["cp-internal"]
    for key in ("reward/mean", "loss/total", "optim/grad_norm", "tokens/response", "prompt/state_bytes"):
        a = single["metrics"][key]
        for run in pair:
            b = run["metrics"][key]
            if key == "prompt/state_bytes":
                assert b < a  # each CP rank keeps only its shard of the pages
                continue
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (key, a, b)
    assert single["metrics"]["optim/grad_norm"] > 0
    for name, value in pair[0]["params"].items():
        assert (value == pair[1]["params"][name]).all(), name


def test_glm5_context_parallel_internal_rollouts_steps_equal_one_process(spawned):
    """GLM-5 decoding its rollouts from the CP-sharded prompt state (MLA latents, DSA indexer
    keys), two steps at CP=2 vs CP=1 from the same converted checkpoint: the second step's
    rewards, finite loss and gradient norm equal CP=1's, and both CP ranks end with the same
    parameters."""
    runs, _ = spawned
    (single,), pair = runs["glm-cp-internal-single"], runs["glm-cp-internal"]
    assert single["metrics"]["optim/grad_norm"] > 0 and math.isfinite(single["metrics"]["loss/total"])
    for key in ("reward/mean", "loss/total", "optim/grad_norm", "tokens/response", "prompt/state_bytes"):
        a = single["metrics"][key]
        for run in pair:
            b = run["metrics"][key]
            if key == "prompt/state_bytes":
                assert b < a  # each CP rank keeps only its shard of the latents and indexer keys
                continue
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (key, a, b)
    for name, value in pair[0]["params"].items():
        assert (value == pair[1]["params"][name]).all(), name


def test_tensor_and_context_parallel_checkpoint_resumes_at_tp1(spawned):
    """A TP=2 x CP=2 run (4 ranks) saves after 2 steps; TP=1, CP=1 loads that checkpoint
    (Megatron's distributed checkpoint reshards model and optimizer) and takes step 3 like the
    4-rank run resumed as it was: the same loss and gradient norm, and parameters whose TP=2
    shards match (on both CP ranks). This also checks that replicated weights whose gradients
    each TP rank computes in part (q/k norms, Gated DeltaNet's output norm) get their TP sums
    before the step. (A fresh TP=1 run is no reference: TP=2 initializes its shards from other
    random streams.) The model is the debug preset with 4 Gated DeltaNet key heads: Megatron's
    config wants them divisible by TP x CP."""
    from megatron_longstraw.models.builder import shard_for_rank

    runs, _ = spawned
    resumed, (resumed_tp1,) = runs["tp-cp-resumed"], runs["tp-cp-at-1"]
    for key in ("loss/total", "reward/mean", "optim/grad_norm"):
        a = resumed_tp1["metrics"][key]
        for run in resumed:
            assert abs(a - run["metrics"][key]) <= 1e-5 * max(1.0, abs(a)), (key, a, run["metrics"][key])
    assert resumed_tp1["metrics"]["optim/grad_norm"] > 0
    for rank, run in enumerate(resumed):  # Megatron's rank order: TP fastest, then CP
        assert set(run["params"]) == set(resumed_tp1["params"])
        for name, value in run["params"].items():
            full = torch.from_numpy(resumed_tp1["params"][name])
            if name in run["tp_splits"]:
                dim, sections = run["tp_splits"][name]
                full = shard_for_rank(full, dim, rank % 2, 2, sections)
            error = (torch.from_numpy(value) - full).abs().max().item()
            assert error <= 1e-5 * max(1.0, full.abs().max().item()), (rank, name, error)


@pytest.mark.parametrize("run,resumed_run", [("pp2", "pp-at-1"), ("pp2-vpp2", "vpp-at-1")])
def test_pipeline_parallel_run_resumes_at_pp1(spawned, run, resumed_run):
    """PP=2, and PP=2 with two virtual stages per rank (Megatron's interleaved schedule; rank 0
    holds layers 0 and 2), with internal rollouts (decoding stage to stage, the last stage
    sampling), scoring and replay through Megatron's schedule: 3 steps with a checkpoint after
    step 2; PP=1 loads that checkpoint (Megatron's distributed checkpoint reshards the stages)
    and takes step 3 like the PP=2 run: the same rewards, loss, gradient norm and updated
    parameters (both stages' layers). Every stage logs the last stage's metrics. (A fresh PP=1
    run is no reference: each stage initializes its layers from its own random stream.)"""
    runs, _ = spawned
    stages, (resumed,) = runs[run], runs[resumed_run]
    for key in ("reward/mean", "loss/total", "optim/grad_norm", "tokens/response", "prompt/state_bytes"):
        a = resumed["metrics"][key]
        for stage in stages:
            b = stage["metrics"][key]
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (key, a, b)
    assert resumed["metrics"]["optim/grad_norm"] > 0
    params = {**stages[0]["params"], **stages[1]["params"]}
    assert set(params) == set(resumed["params"]) and set(stages[0]["params"]) != set(stages[1]["params"])
    for name, value in params.items():
        full = resumed["params"][name]
        error = float(abs(value - full).max())
        assert error <= 1e-5 * max(1.0, float(abs(full).max())), (name, error)


def test_pipeline_parallel_exact_prompt_gradient_step_equals_one_process(spawned):
    """``--prompt-gradient exact`` under PP=2 (exact replay through Megatron's schedule, then the
    reverse sweep stage to stage) takes step 3 from the PP=2 run's step-2 checkpoint like PP=1
    from the same checkpoint: the same rewards, loss, gradient norm, state-gradient bytes (summed
    over the stages) and updated parameters; the gradient norm differs from the detached step's."""
    runs, _ = spawned
    stages, (single,), (detached,) = runs["pp2-exact"], runs["pp-exact-at-1"], runs["pp-at-1"]
    for key in ("reward/mean", "loss/total", "optim/grad_norm", "prompt/state_grad_bytes"):
        a = single["metrics"][key]
        for stage in stages:
            b = stage["metrics"][key]
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (key, a, b)
    assert single["metrics"]["prompt/state_grad_bytes"] > 0 and stages[0]["metrics"]["time/prompt_backward_s"] > 0
    grad_norm = single["metrics"]["optim/grad_norm"]
    assert abs(detached["metrics"]["optim/grad_norm"] - grad_norm) > 1e-3 * grad_norm
    params = {**stages[0]["params"], **stages[1]["params"]}
    assert set(params) == set(single["params"])
    for name, value in params.items():
        full = single["params"][name]
        error = float(abs(value - full).max())
        assert error <= 1e-5 * max(1.0, float(abs(full).max())), (name, error)


@pytest.mark.parametrize("loss_type", ["dr_grpo", "gspo", "cispo"])
def test_each_loss_type_trains_a_step(tmp_path, monkeypatch, loss_type):
    """``--loss-type`` end to end: one step on two external rollout groups, the loss finite, the
    parameters moved and, at ratio 1, ``loss/total`` the loss's own normalization of ``-A``."""
    from megatron_longstraw.grpo.advantages import group_advantages

    initial, build_policy = {}, loop.build_policy

    def keep_initial(args):
        built = build_policy(args)
        initial.update({n: p.detach().clone() for n, p in built[1].named_parameters()})
        return built

    monkeypatch.setattr(loop, "build_policy", keep_initial)
    path = _rollout_file(tmp_path)
    metrics, params = _train(_args(tmp_path, "--loss-type", loss_type, "--train-iters", "1", "--no-save",
                                   "--wandb-mode", "disabled", "--max-response-length", "8", "--rollout-source",
                                   "jsonl", "--rollout-path", str(path), "--reward-fn", "exact_match"))
    assert abs(metrics["loss/total"]) < float("inf") and metrics["ratio/max"] == 1.0
    assert metrics["optim/grad_norm"] > 0
    assert any(not torch.equal(initial[name], value) for name, value in params.items())
    groups = [json.loads(line) for line in path.read_text().splitlines()]
    if loss_type == "dr_grpo":  # token sums of -(r - mean r) over 8 (--max-response-length) x 6 responses
        expected = sum(-a * len(r) for g in groups for a, r in
                       zip(group_advantages(torch.tensor(g["rewards"]), "none").tolist(), g["responses"])) / 48
    elif loss_type == "gspo":  # s_i = 1: the mean over the 6 responses of -A (group-std)
        expected = sum(-a for g in groups for a in group_advantages(torch.tensor(g["rewards"])).tolist()) / 6
        assert metrics["ratio/sequence_max"] == 1.0
    else:
        return
    assert abs(metrics["loss/total"] - expected) <= 1e-6, (metrics["loss/total"], expected)


OUT_OF_TREE_LOSS = '''"""A loss outside the package: plain REINFORCE, -A logp per token over the global token count."""

from megatron_longstraw.grpo.loss_base import PolicyLoss
from megatron_longstraw.grpo.loss_terms import aggregated_sum


class Reinforce(PolicyLoss):
    metric_names = {**PolicyLoss.metric_names, "policy_loss": "reinforce/policy"}

    @classmethod
    def group_normalizer(cls, config, step, num_responses):
        return 1.0

    @classmethod
    def finish_step(cls, metrics, config, step):
        metrics["loss/total"] = metrics.pop("loss/sum") / metrics["tokens/response"]
        return step.data_parallel_size / metrics["tokens/response"]

    def loss(self, batch):
        policy_RB = -batch.advantages_B.unsqueeze(0) * batch.logprobs_RB
        self.add_token_metric("policy_loss", policy_RB, batch.real_RB)
        return aggregated_sum(self.regularized(policy_RB, batch), batch.real_RB, "token") / self.normalizer


class NotALoss:
    pass
'''


def test_an_out_of_tree_loss_trains_a_step(tmp_path, monkeypatch):
    """``--loss-type module:Class`` (a ``PolicyLoss`` subclass importable from the working
    directory): one step on two rollout groups moves the parameters, with the metrics the loss
    names (its policy term under its own name); a module that does not import, a class that is
    not a loss, are one line each naming the flag."""
    (tmp_path / "my_losses.py").write_text(OUT_OF_TREE_LOSS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    initial, build_policy = {}, loop.build_policy

    def keep_initial(config):
        built = build_policy(config)
        initial.update({n: p.detach().clone() for n, p in built[1].named_parameters()})
        return built

    monkeypatch.setattr(loop, "build_policy", keep_initial)
    path = _rollout_file(tmp_path)
    argv = _args(tmp_path, "--train-iters", "1", "--no-save", "--wandb-mode", "disabled", "--max-response-length",
                 "8", "--rollout-source", "jsonl", "--rollout-path", str(path), "--reward-fn", "exact_match")
    metrics, params = _train(argv + ["--loss-type", "my_losses:Reinforce"])
    assert metrics["optim/grad_norm"] > 0 and math.isfinite(metrics["loss/total"])
    assert math.isfinite(metrics["reinforce/policy"]) and "loss/policy" not in metrics
    assert metrics["kl/approx"] == 0.0  # the shared terms come with every loss
    assert any(not torch.equal(initial[name], value) for name, value in params.items())
    for spec, needle in (("my_losses:NotALoss", "my_losses.NotALoss is not a PolicyLoss subclass"),
                         ("no_such_losses:Reinforce", "cannot import no_such_losses")):
        with pytest.raises(ValueError, match=f"^--loss-type {spec}: {needle}"):
            train_grpo.parse_args(argv + ["--loss-type", spec])


@pytest.mark.parametrize("model", ["qwen3.5-debug", "glm-5-debug"])
def test_exact_prompt_gradient_step_equals_full_backprop(tmp_path, model):
    """``--prompt-gradient exact``, both families (GLM-5: MLA + DSA + MoE): one step's gradient
    (its norm, before clipping) equals plain backprop through prompt + responses
    (``--replay-mode full --prompt-gradient exact``) and differs from the detached one's; the
    state-gradient bytes and the sweep's time are logged."""
    path = _rollout_file(tmp_path)
    common = ("--model", model, "--train-iters", "1", "--no-save", "--wandb-mode", "disabled",
              "--max-response-length", "8", "--rollout-source", "jsonl", "--rollout-path", str(path),
              "--reward-fn", "exact_match", "--clip-grad", "0")
    exact, _ = _train(_args(tmp_path / "exact", *common, "--prompt-gradient", "exact"))
    full, _ = _train(_args(tmp_path / "full", *common, "--prompt-gradient", "exact", "--replay-mode", "full"))
    detached, _ = _train(_args(tmp_path / "detached", *common))
    assert abs(exact["optim/grad_norm"] - full["optim/grad_norm"]) <= 1e-5 * full["optim/grad_norm"]
    assert abs(exact["loss/total"] - full["loss/total"]) <= 1e-6
    assert abs(detached["optim/grad_norm"] - full["optim/grad_norm"]) > 1e-3 * full["optim/grad_norm"]
    assert exact["prompt/state_grad_bytes"] > 0 and exact["time/prompt_backward_s"] > 0

def test_exact_prompt_gradient_stays_on_policy_and_resumes_exactly(tmp_path):
    """Internal rollouts in exact mode: the ratio is 1 at every step, and 1 step + save + load + 1
    step gives the parameters and metrics of 2 steps straight."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ("--prompt-gradient", "exact", "--train-iters", "2")
    _, params_straight = _train(_args(straight, *flags))
    _train(_args(resumed, *flags[:2], "--train-iters", "1"))
    _, params_resumed = _train(_args(resumed, *flags, "--load", str(resumed / "ckpt")))
    for name, value in params_straight.items():
        assert torch.equal(value, params_resumed[name]), name
    rows_straight, rows_resumed = _rows(straight / "wandb"), _rows(resumed / "wandb")
    assert [r["step"] for r in rows_resumed] == [1, 2]
    for a, b in zip(rows_straight, rows_resumed):
        assert _deterministic(a) == _deterministic(b)
        assert a["ratio/max"] == 1.0 and a["kl/approx"] == 0.0

