"""``KernelOptions`` (``attention/kernel_options.py``): bad values name their flag, and the
trainer's and the benchmark's ``kernels`` flags reach the kernels of the model they build (the
prefix block sets how many blocks the emulated full-attention path runs; the DSA key block the
width of every index-score block)."""

import sys
from pathlib import Path

import pytest
import torch

from megatron_longstraw.attention import prefix_attention_cuda
from megatron_longstraw.attention.kernel_options import set_kernel_options
from megatron_longstraw.attention.sdpa_core import SDPACoreAttention
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.replay import replay_logits
from megatron_longstraw.models.glm5.layers import LongStrawDSAIndexer, LongStrawDSAttention
from megatron_longstraw.patches.dsa_causal_topk import dsa
from megatron_longstraw.testing.parity import random_tokens
from megatron_longstraw.training.arguments import parse_args
from megatron_longstraw.training.setup import build_policy

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("field,value,flag", [
    ("attention_backend", "cuda", "--attention-backend"), ("prefix_block", 0, "--prefix-block"),
    ("dsa_key_block", -3, "--dsa-key-block"), ("dsa_score_elements", 2.5, "--dsa-score-elements"),
    ("dsa_gather_elements", 0, "--dsa-gather-elements"), ("dsa_topk", "sorted", "--dsa-topk"),
    ("decode_split_keys", 0, "--decode-split-keys")])
def test_bad_options_name_their_flag(field, value, flag):
    KernelOptions()
    with pytest.raises(ValueError, match=f"^{flag} must be"):
        KernelOptions(**{field: value})


def test_trainer_and_benchmark_parse_the_kernel_flags():
    flags = ["--attention-backend", "flash", "--prefix-block", "9", "--dsa-key-block", "8", "--dsa-score-elements",
             "700", "--dsa-gather-elements", "600", "--dsa-topk", "float", "--decode-split-keys", "5"]
    want = KernelOptions(attention_backend="flash", prefix_block=9, dsa_key_block=8, dsa_score_elements=700,
                         dsa_gather_elements=600, dsa_topk="float", decode_split_keys=5)
    assert parse_args([]).kernels == KernelOptions()
    assert parse_args(flags).kernels == want
    with pytest.raises(ValueError, match="--prefix-block must be an integer >= 1, got 0"):
        parse_args(["--prefix-block", "0"])
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_longstraw import parse_args as bench_args

    assert bench_args(flags).kernels == want
    with pytest.raises(ValueError, match="--dsa-gather-elements must be an integer >= 1"):
        bench_args(["--dsa-gather-elements", "-1"])


def _prefix_blocks(monkeypatch):
    """Records the number of keys of every prefix (unmasked) kernel call of full attention."""
    sizes, forward = [], prefix_attention_cuda.kernel_forward

    def counting(backend, q, k, v, causal, scale):
        if not causal:
            sizes.append(k.shape[-2])
        return forward(backend, q, k, v, causal, scale)

    monkeypatch.setattr(prefix_attention_cuda, "kernel_forward", counting)
    return sizes


def test_prefix_block_flag_reaches_the_attention_kernels(single_process, monkeypatch):
    """The trainer's build with ``--attention-backend emulated --prefix-block 4``: a response
    replayed over a 13-token prompt runs 4 prefix blocks (4, 4, 4, 1 keys) per full-attention
    layer, where the default block runs one; the logits are those of the math path."""
    sizes = _prefix_blocks(monkeypatch)
    prompt_length = 13
    for flags, blocks in ((["--attention-backend", "emulated", "--prefix-block", "4"], [4, 4, 4, 1]),
                          (["--attention-backend", "emulated"], [13])):
        args = parse_args(flags)
        hf, model, _, _ = build_policy(args)
        layers = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
        assert layers and all(m.kernel_options == args.kernels for m in layers)
        prompt, response = random_tokens(hf, prompt_length, 1), random_tokens(hf, 5, 2)
        with torch.no_grad():
            state = capture_prompt(model, prompt, prompt_length)
            sizes.clear()
            logits = replay_logits(model, state, response)
            assert sizes == blocks * len(layers), (flags, sizes)
            set_kernel_options(model, KernelOptions())  # on a CPU: the math path
            math_logits = replay_logits(model, capture_prompt(model, prompt, prompt_length), response)
        assert not sizes[len(blocks) * len(layers):]  # the math path runs no kernel part
        assert (logits - math_logits).abs().max().item() <= 1e-5


def test_dsa_key_block_flag_reaches_the_indexer(single_process, monkeypatch):
    """GLM-5 built by the trainer with ``--dsa-key-block 3``: every module with DSA kernels has
    the parsed options, and no index-score block of a capture is wider than 3 keys."""
    args = parse_args(["--model", "glm-5-debug", "--dsa-key-block", "3"])
    hf, model, _, _ = build_policy(args)
    modules = [m for m in model.modules() if isinstance(m, (LongStrawDSAIndexer, LongStrawDSAttention))]
    assert modules and all(m.kernel_options == args.kernels for m in modules)
    widths, scores = [], dsa._compute_index_scores
    monkeypatch.setattr(dsa, "_compute_index_scores", lambda *a, **k: widths.append(scores(*a, **k).shape[-1])
                        or scores(*a, **k))
    with torch.no_grad():
        capture_prompt(model, random_tokens(hf, 10, 1), 10)
    assert widths and max(widths) == 3
