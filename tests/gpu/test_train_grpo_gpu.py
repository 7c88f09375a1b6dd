"""GPU tier: the trainer's steps run on CUDA in bf16 (devices, Megatron's optimizer without gloo
groups, metric reductions) and stay on-policy."""

import json

import pytest

pytestmark = pytest.mark.gpu


def test_trainer_bf16_steps_on_gpu(tmp_path):
    from megatron_longstraw.distributed import destroy_distributed, init_distributed
    from megatron_longstraw.training.arguments import parse_args
    from megatron_longstraw.training.loop import train

    argv = ["--bf16", "--train-iters", "2", "--global-batch-size", "2", "--num-generations", "4",
            "--synthetic-prompt-length", "4000", "--prompt-chunk-size", "1024", "--max-response-length", "16",
            "--save", str(tmp_path / "ckpt"), "--wandb-save-dir", str(tmp_path / "w"), "--wandb-mode", "disabled",
            "--kl-coef", "0.01"]
    args = parse_args(argv)
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        metrics, model = train(args)
    finally:
        destroy_distributed()
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert next(model.parameters()).is_cuda
    assert all(r["mem/peak_gib"] > 0 and r["time/capture_s"] > 0 for r in rows)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
