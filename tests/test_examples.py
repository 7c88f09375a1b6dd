"""The launch scripts of ``examples/``: each, run as written for the hardware its header names,
hands ``train_grpo.py`` an argument list the trainer accepts for that many processes, through the
project's interpreter and ``torch.distributed.run`` with the multi-node variables
(``examples/args/distributed.sh``) and the recipe variables (``examples/args/recipe.sh``).

The interpreter is replaced by a stub that records its arguments (``PYTHON=...``, the scripts'
own override), so nothing is launched."""

import os
import subprocess
from pathlib import Path

import pytest

from megatron_longstraw.training.arguments import parse_args

ROOT = Path(__file__).resolve().parents[1]


def _launch(tmp_path, script: str, env: dict, *args: str) -> list[str]:
    """The arguments ``examples/{script} args...`` gives the interpreter, with ``env`` set."""
    record = tmp_path / "argv"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "{record}"\n')
    stub.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    subprocess.run(["bash", str(ROOT / "examples" / script), *args], check=True, capture_output=True, timeout=60,
                   env={**base, "PYTHON": str(stub), "RUN_DIR": str(tmp_path / "run"), **env})
    return record.read_text().split("\0")[:-1]


def _split(argv: list[str]) -> tuple[dict, list[str]]:
    """``(launcher options, train_grpo.py arguments)``; the launcher runs as ``-m torch.distributed.run``."""
    assert argv[:2] == ["-m", "torch.distributed.run"], argv[:4]
    at = argv.index("train_grpo.py")
    launcher = argv[2:at]
    return dict(zip(launcher[::2], launcher[1::2])), argv[at + 1:]


def test_qwen_recipe_one_node_and_multi_node(tmp_path):
    """One node of 8 GPUs by default; four nodes through NNODES / NODE_RANK / MASTER_ADDR, the
    global batch then one prompt per TP x CP replica; the recipe variables become flags."""
    launcher, argv = _split(_launch(tmp_path, "qwen3.6-27b_2m_tp4_cp2.sh", {}))
    assert launcher == {"--nproc-per-node": "8", "--nnodes": "1", "--node-rank": "0",
                        "--master-addr": "localhost", "--master-port": "6000"}
    args = parse_args(argv, world_size=8)
    assert (args.parallel.tensor_model_parallel_size, args.parallel.context_parallel_size,
            args.training.global_batch_size) == (4, 2, 1)
    assert args.checkpoint.save == str(tmp_path / "run" / "checkpoints") and args.data.data_path == "synthetic"

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    launcher, argv = _split(_launch(tmp_path, "qwen3.6-27b_2m_tp4_cp2.sh", {
        "NNODES": "4", "NODE_RANK": "2", "MASTER_ADDR": "node0", "DATA_PATH": str(prompts),
        "TOKENIZER_MODEL": str(tmp_path), "CHECKPOINT_PATH": str(tmp_path / "ckpt")}))
    assert (launcher["--nnodes"], launcher["--node-rank"], launcher["--master-addr"]) == ("4", "2", "node0")
    args = parse_args(argv, world_size=32)
    assert args.training.global_batch_size == 4 and args.data.data_path == str(prompts)
    assert args.data.tokenizer_type == "HuggingFaceTokenizer" and args.checkpoint.save == str(tmp_path / "ckpt")


def test_glm_recipe_decodes_under_cp_or_trains_on_rollouts_it_is_given(tmp_path):
    """GLM-5 under CP 32 on four nodes: without ROLLOUT_PATH it samples its responses from the
    CP-sharded state (internal rollouts); with it, its prompt groups come from that file."""
    launcher, argv = _split(_launch(tmp_path, "glm-5_2m_cp32.sh", {"ROLLOUT_PATH": ""}))  # unset
    assert launcher["--nnodes"] == "4" and launcher["--nproc-per-node"] == "8"
    args = parse_args(argv, world_size=32)
    assert (args.parallel.context_parallel_size, args.parallel.expert_model_parallel_size) == (32, 32)
    assert args.rollout.rollout_source == "internal" and args.rollout.rollout_path is None
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text('{"prompt_ids": [1, 2], "responses": [[3]]}\n')
    launcher, argv = _split(_launch(tmp_path, "glm-5_2m_cp32.sh", {"ROLLOUT_PATH": str(rollouts)}))
    assert launcher["--nnodes"] == "4" and launcher["--nproc-per-node"] == "8"
    args = parse_args(argv, world_size=32)
    assert (args.parallel.context_parallel_size, args.parallel.expert_model_parallel_size) == (32, 32)
    assert args.rollout.rollout_source == "jsonl" and args.rollout.rollout_path == str(rollouts)


def _launches(tmp_path, script: str, env: dict, *args: str) -> list[list[str]]:
    """Every argument list ``examples/{script} args...`` gives the interpreter, in order."""
    record = tmp_path / "argvs"
    record.unlink(missing_ok=True)
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" >> "{record}"\nprintf "\\n" >> "{record}"\n')
    stub.chmod(0o755)
    subprocess.run(["bash", str(ROOT / "examples" / script), *args], check=True, capture_output=True, timeout=60,
                   env={**os.environ, "PYTHON": str(stub), **env})
    return [line.split("\0") for line in record.read_text().split("\0\n")[:-1]]


def test_retrieval_study_runs_both_modes_alike(tmp_path):
    """The study's two arms differ only in ``--prompt-gradient`` and their folders; the supervised
    warm start runs while its checkpoint is missing, then GRPO starts from it (and, on a later
    launch, resumes its own checkpoint; the warm start does not run again); GRPO stops within a
    10-minute job; an evaluation-only launch takes the extra flags; a wrong mode is one line and a
    non-zero exit."""
    runs = {}
    for mode in ("exact", "detached"):
        run = str(tmp_path / mode)
        warm, grpo = _launches(tmp_path, "retrieval_study.sh", {"RUN_DIR": run}, mode)
        assert warm[0] == grpo[0] == "train_grpo.py"
        at = grpo.index("--pretrained-checkpoint")  # (parsing would look for the checkpoint)
        assert grpo[at + 1] == f"{run}/warm"
        warm_args, args = parse_args(warm[1:]), parse_args(grpo[1:at] + grpo[at + 2:])
        assert warm_args.loss.loss_type == "sft" and warm_args.checkpoint.save == f"{run}/warm"
        assert warm_args.longstraw.prompt_gradient == args.longstraw.prompt_gradient == mode
        assert warm_args.training.train_iters == 25
        assert args.loss.loss_type == "grpo" and args.checkpoint.save == f"{run}/checkpoints"
        assert args.checkpoint.exit_duration_in_mins < 10 and args.curriculum.longest == 32768
        assert args.evaluation.eval_interval
        runs[mode] = [[a for a in argv if a != mode and run not in a and not a.startswith(f"retrieval-{mode}")]
                      for argv in (warm, grpo)]
    assert runs["exact"] == runs["detached"]
    (tmp_path / "exact" / "warm").mkdir(parents=True)
    (tmp_path / "exact" / "warm" / "latest_checkpointed_iteration.txt").write_text("25")
    (tmp_path / "ckpt").mkdir()  # (read only when the run starts)
    launches = _launches(tmp_path, "retrieval_study.sh", {"RUN_DIR": str(tmp_path / "exact")}, "exact",
                         "--skip-train", "--load", str(tmp_path / "ckpt"), "--eval-prompt-lengths", "131072,524288")
    assert len(launches) == 1  # the warm start is there: GRPO (here its evaluation) only
    at = launches[0].index("--pretrained-checkpoint")
    args = parse_args(launches[0][1:at] + launches[0][at + 2:])
    assert args.evaluation.skip_train and args.eval_lengths == [131072, 524288]
    assert args.checkpoint.load == str(tmp_path / "ckpt")
    bad = subprocess.run(["bash", str(ROOT / "examples/retrieval_study.sh"), "full"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHON": "false"})
    assert bad.returncode == 2 and bad.stderr.strip() == "error: the mode must be exact or detached, got 'full'"
