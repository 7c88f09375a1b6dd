"""``--loss-type sft``: supervised fine-tuning on the records' answers through capture and replay,
in both prompt-gradient modes; its loss against an independent forward, its gradient against
plain backprop, and the flags it refuses."""

import json
from pathlib import Path

import pytest
import torch

import train_grpo
from megatron_longstraw.data.synthetic import KeyValueRetrievalTask
from megatron_longstraw.distributed import destroy_distributed, init_distributed
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.training import loop, setup

PROMPT, ANSWER = 30, 3  # value of 2 ids + EOS
_NLL = {}  # the answers' NLL under the initial weights, from keep_initial


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--loss-type", "sft", "--train-iters", "1", "--global-batch-size", "2", "--synthetic-prompt-length",
            str(PROMPT), "--synthetic-num-records", "2", "--synthetic-value-length", str(ANSWER - 1),
            "--reward-fn", "synthetic_retrieval", "--max-response-length", "4", "--prompt-chunk-size", "16",
            "--lr", "1e-2", "--clip-grad", "0", "--no-save", "--wandb-mode", "disabled",
            "--wandb-save-dir", str(tmp_path), *extra]


def _train(argv, monkeypatch=None):
    args = train_grpo.parse_args(argv)
    if monkeypatch is not None:
        build_policy = setup.build_policy

        def keep_initial(a):
            built = build_policy(a)
            _NLL["initial"] = _answer_nll(built[1], a)  # before any step
            return built

        monkeypatch.setattr(loop, "build_policy", keep_initial)
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        metrics, _ = loop.train(args)
    finally:
        destroy_distributed()
    return metrics


@torch.no_grad()
def _answer_nll(model, args) -> float:
    """The token mean of ``-log p(answer | prompt)`` over the step's two synthetic prompts, by one
    plain forward of prompt + answer (no capture, no replay)."""
    hf = resolve_hf_config("qwen3.5-debug")
    task = KeyValueRetrievalTask(hf["vocab_size"], PROMPT, num_records=2, key_length=1, value_length=ANSWER - 1,
                                 eos_id=hf["vocab_size"] - 1, seed=args.training.seed)
    total, tokens = 0.0, 0
    for index in range(2):
        prompt_P, answer_A, _ = task.generate(index)
        ids_1T = torch.cat([prompt_P, answer_A])[None]
        position_ids = torch.arange(ids_1T.shape[1])[None]
        logits = model(ids_1T, position_ids, None).float()  # [1, T, vocab] (no labels)
        logprobs = logits[0, PROMPT - 1:-1, : hf["vocab_size"]].log_softmax(-1)
        total -= logprobs.gather(-1, answer_A[:, None]).sum().item()
        tokens += answer_A.numel()
    return total / tokens


def test_sft_loss_is_the_answers_negative_log_likelihood_and_falls(tmp_path, monkeypatch):
    """Step 1's ``loss/total`` (computed with the initial weights) is the token-mean NLL of the two
    prompts' answers that a plain forward of prompt + answer gives; the responses are the answers
    (3 tokens each), their reward 1; three steps lower it."""
    _train(_args(tmp_path, "--prompt-gradient", "exact", "--train-iters", "3", "--wandb-mode", "offline"),
           monkeypatch)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    nll = _NLL["initial"]
    first = rows[0]
    assert first["tokens/response"] == 2 * ANSWER and first["reward/mean"] == 1.0
    assert abs(first["loss/total"] - nll) <= 1e-5 * max(1.0, nll), (first["loss/total"], nll)
    assert first["clip/frac_low"] == 0 and first["clip/frac_high"] == 0
    # measured 5.60 -> 5.29 at step 3 (random weights: log 256 = 5.5 per token)
    assert rows[-1]["loss/total"] < first["loss/total"] - 0.15, [r["loss/total"] for r in rows]


def test_sft_exact_gradient_equals_full_backprop_and_differs_from_detached(tmp_path):
    """One step's gradient norm (no clipping) in exact mode equals plain backprop through prompt +
    answer (``--replay-mode full --prompt-gradient exact``); detached has the same loss but not
    the prompt's share of the gradient."""
    exact = _train(_args(tmp_path / "e", "--prompt-gradient", "exact"))
    full = _train(_args(tmp_path / "f", "--prompt-gradient", "exact", "--replay-mode", "full"))
    detached = _train(_args(tmp_path / "d"))
    assert abs(exact["optim/grad_norm"] - full["optim/grad_norm"]) <= 1e-5 * full["optim/grad_norm"]
    assert abs(exact["loss/total"] - detached["loss/total"]) <= 1e-6  # the same forward
    assert abs(detached["optim/grad_norm"] - full["optim/grad_norm"]) > 1e-3 * full["optim/grad_norm"]


@pytest.mark.parametrize("extra,needle", [
    (["--dynamic-sampling"], "--loss-type sft trains on given responses: --dynamic-sampling"),
    (["--rollout-correction", "tis"], "--loss-type sft trains on given responses: --rollout-correction tis"),
])
def test_sft_refuses_what_has_nothing_to_act_on(tmp_path, extra, needle):
    with pytest.raises(ValueError, match=needle):
        train_grpo.parse_args(_args(tmp_path, *extra))


def test_a_text_answer_is_refused_naming_the_record(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt_ids": [5, 6, 7, 8], "answer": "forty-two"}) + "\n")
    args = train_grpo.parse_args(_args(tmp_path, "--data-path", str(data), "--reward-fn", "exact_match",
                                       "--global-batch-size", "1"))
    init_distributed(args.parallel.sizes, seed=args.training.seed)
    try:
        with pytest.raises(ValueError, match=rf"--loss-type sft: record {data}:1 has no token-id answer"):
            loop.train(args)
    finally:
        destroy_distributed()
