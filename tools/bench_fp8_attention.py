"""FP8 attention in the capture (``--fp8-attention capture``) against the bf16 capture of the same
model in the same process: capture time and MFU (counted against the bf16 peak), the last
position's log-probabilities, and the replay loss and gradients against each capture's state.

For every prompt length the same bf16 model (random weights) captures the same prompt twice,
once with its bf16 attention and once with every full-attention core's capture in FP8
(``attention/fp8_capture_attention.py``), and replays the same responses (loss
``-sum(logprobs) / response tokens``, as ``tools/fp8_sensitivity.py``) against each state.
At the lengths of ``--emulation-prompt-lengths`` it also captures with the exact FP8 emulation
(``testing/fp8_attention_emulation.py``: an ideal FP8 kernel, whole rows; it materializes the
chunk's scores, so keep those lengths short), whose figures say how far FP8 attention itself
moves the model: the kernel's loss and cosine against bf16 should be no worse than the
emulation's.

    python tools/bench_fp8_attention.py --model qwen3.5-0.8b --max-position-embeddings 2200000 \\
        --prompt-lengths 524288,1048576,2097152 --emulation-prompt-lengths 65536 --response-length 1024 \\
        --num-generations 2 --output-dir docs/bench

``--fp8-kernel emulated`` runs the same orchestration on the emulated cuDNN kernel
(``emulated_sdpa_fp8``), on any machine (the CPU tests); its times say nothing.
"""

import argparse
import functools
import sys
import time
from pathlib import Path

from megatron_longstraw.config import cli
from megatron_longstraw.config.benchmark import BenchOutputConfig, LongStrawBenchConfig
from megatron_longstraw.config.grpo import GRPOConfig
from megatron_longstraw.config.longstraw import LongStrawConfig
from megatron_longstraw.config.model import ModelConfig
from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.config.workload import WorkloadConfig


def build_parser() -> argparse.ArgumentParser:
    """The tool's flags: the shared ones from the configuration (``config/``), its own below."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_flags(p, ModelConfig, only=("model", "num_layers", "max_position_embeddings", "yarn_factor"))
    cli.add_flags(p, WorkloadConfig, only=("prompt_lengths", "response_length"))
    cli.add_flags(p, GRPOConfig, only=("num_generations",), about="responses replayed against each capture")
    cli.add_flags(p, LongStrawConfig, only=("prompt_chunk_size",))
    cli.add_flags(p, LongStrawBenchConfig, only=("warmup_prompt_length",))
    cli.add_flags(p, BenchOutputConfig)
    g = p.add_argument_group("FP8 attention")
    g.add_argument("--emulation-prompt-lengths", default="65536",
                   help="comma-separated prompt lengths also captured with the exact FP8 emulation (short: "
                        "it materializes each chunk's scores); empty for none (default: 65536)")
    g.add_argument("--emulation-chunk-size", type=int, default=4096,
                   help="capture chunk at the emulation's lengths (every variant of that length uses it) "
                        "(default: 4096)")
    g.add_argument("--fp8-kernel", default="cudnn", choices=["cudnn", "emulated"],
                   help="cudnn: cuDNN's sdpa_fp8 (Hopper, nvidia-cudnn-frontend); emulated: the same "
                        "orchestration on its torch emulation (any machine, times meaningless) (default: cudnn)")
    return p


if __name__ == "__main__":
    build_parser().parse_args()  # --help and a bad flag answer before torch and Megatron load

import torch  # noqa: E402

from megatron_longstraw.attention import fp8_capture_attention as fp8  # noqa: E402
from megatron_longstraw.attention.sdpa_core import SDPACoreAttention, capture_attention_as  # noqa: E402
from megatron_longstraw.checkpointing.model_checkpoint import model_hf_config  # noqa: E402
from megatron_longstraw.distributed import destroy_distributed, device, init_distributed  # noqa: E402
from megatron_longstraw.longstraw.capture import capture_prompt  # noqa: E402
from megatron_longstraw.longstraw.cost_model import prompt_flops  # noqa: E402
from megatron_longstraw.longstraw.replay import replay_responses  # noqa: E402
from megatron_longstraw.models.builder import build_model  # noqa: E402
from megatron_longstraw.models.options import ModelOptions  # noqa: E402
from megatron_longstraw.rollout.generate import full_vocab_logits  # noqa: E402
from megatron_longstraw.testing.fp8_attention_emulation import emulated_fp8_capture_attention, emulated_sdpa_fp8  # noqa: E402
from bench_output import bench_stem, command_line, write_bench_files  # noqa: E402 (tools/, beside this script)
from fp8_sensitivity import compare  # noqa: E402

PEAK_TFLOPS = 785.0  # measured bf16 matmul peak of the H200 host (docs/longstraw_benchmark.md)


def comma_lengths(text: str, flag: str) -> list[int]:
    """The positive token counts of a comma-separated flag value; ``ValueError`` naming the flag."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError as err:
        raise ValueError(f"{flag} {text!r}: give comma-separated token counts") from err
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} {text!r}: every length must be >= 1")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    """The tool's flags, the shared ones checked by their configuration groups."""
    args = build_parser().parse_args(argv)
    for group in (ModelConfig, WorkloadConfig, GRPOConfig, LongStrawConfig, LongStrawBenchConfig):
        cli.group_from(args, group)
    args.emulation_prompt_lengths = comma_lengths(args.emulation_prompt_lengths, "--emulation-prompt-lengths")
    if args.emulation_chunk_size < 1:
        raise ValueError(f"--emulation-chunk-size must be >= 1, got {args.emulation_chunk_size}")
    return args


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def capture_and_replay(model, prompt_1S, responses, chunk_size: int) -> dict:
    """One timed capture, its last position's log-probs, and the replay of ``responses`` against
    it from zeroed gradients: ``{capture_s, logprobs, loss, grads}`` (grads fp32, by name)."""
    model.zero_grad(set_to_none=True)
    _sync()
    start = time.perf_counter()
    with torch.no_grad():
        state = capture_prompt(model, prompt_1S, chunk_size)
    _sync()
    seconds = time.perf_counter() - start
    try:
        logprobs = full_vocab_logits(model, state.last_logits_BV).log_softmax(-1)
        tokens = sum(len(r) for r in responses)
        loss = sum(replay_responses(model, state, responses, lambda lp, mask, idx: -(lp * mask).sum() / tokens, 1))
    finally:
        state.free()
    grads = {n: p.grad.detach().float().flatten().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return dict(capture_s=seconds, logprobs=logprobs, loss=float(loss), grads=grads)


def against(reference: dict, measured: dict) -> dict:
    """The measured variant's figures against the bf16 reference's."""
    row = compare((reference["loss"], reference["grads"]), (measured["loss"], measured["grads"]))
    row.pop("per_param")
    row["logprob_mean_abs"] = (measured["logprobs"] - reference["logprobs"]).abs().mean().item()
    row["capture_s"] = measured["capture_s"]
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    command = command_line(argv)
    init_distributed(ParallelSizes(), seed=1234)
    try:
        hf = model_hf_config(cli.group_from(args, ModelConfig))
        torch.manual_seed(0)
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        model = build_model(hf, ModelOptions(params_dtype=dtype))
        cores = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
        if not cores:
            raise ValueError(f"--model {_name(args)}: no full-attention layer for FP8 attention in the capture")
        if args.fp8_kernel == "cudnn":
            fp8.check_supported([core.config.kv_channels for core in cores], device())
            kernel = fp8.fp8_capture_attention
        else:
            kernel = functools.partial(fp8.fp8_capture_attention, kernel=emulated_sdpa_fp8)
        gen = torch.Generator().manual_seed(0)
        responses = [torch.randint(0, hf["vocab_size"], (args.response_length,), generator=gen).to(device())
                     for _ in range(args.num_generations)]
        if args.warmup_prompt_length:  # every chunk size measured below: its kernels and cuDNN graphs
            warm = torch.randint(0, hf["vocab_size"], (1, args.warmup_prompt_length), generator=gen).to(device())
            chunks = {args.prompt_chunk_size} | ({args.emulation_chunk_size} if args.emulation_prompt_lengths else set())
            for chunk in sorted(chunks):
                for attend in (None, kernel):
                    with capture_attention_as(model, attend):
                        capture_and_replay(model, warm, responses, chunk)
        rows = []
        lengths = sorted(set(args.prompt_lengths) | set(args.emulation_prompt_lengths))
        for length in lengths:
            prompt = torch.randint(0, hf["vocab_size"], (1, length), generator=gen).to(device())
            emulate = length in args.emulation_prompt_lengths
            chunk = args.emulation_chunk_size if emulate else args.prompt_chunk_size
            bf16 = capture_and_replay(model, prompt, responses, chunk)
            with capture_attention_as(model, kernel):
                measured = against(bf16, capture_and_replay(model, prompt, responses, chunk))
            row = dict(prompt_length=length, chunk=chunk, bf16_capture_s=bf16["capture_s"], fp8=measured)
            flops = prompt_flops(hf, model, length)
            if flops:
                row["bf16_mfu"] = flops / bf16["capture_s"] / (PEAK_TFLOPS * 1e12)
                row["fp8_mfu_of_bf16_peak"] = flops / measured["capture_s"] / (PEAK_TFLOPS * 1e12)
            if emulate:
                with emulated_fp8_capture_attention(model):
                    row["emulation"] = against(bf16, capture_and_replay(model, prompt, responses, chunk))
            del bf16
            rows.append(row)
            write_report(args, command, hf, rows)  # after every length: a run cut short keeps its rows
            print(f"{length}: bf16 {row['bf16_capture_s']:.2f} s, fp8 {measured['capture_s']:.2f} s "
                  f"({row['bf16_capture_s'] / measured['capture_s']:.2f}x), log-probs {measured['logprob_mean_abs']:.2e}, "
                  f"cosine {measured['cosine']:.4f}" + (f", emulation cosine {row['emulation']['cosine']:.4f}"
                                                       if emulate else ""), flush=True)
    finally:
        destroy_distributed()
    print((Path(args.output_dir) / (bench_stem("fp8_attention", _name(args), args.tag) + ".md")).read_text())


def _name(args) -> str:
    """The model as the results name it."""
    return cli.group_from(args, ModelConfig).name


def write_report(args, command, hf, rows) -> None:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    dtype = "bf16" if torch.cuda.is_available() else "fp32"
    lines = [f"# FP8 attention in the capture: {_name(args)} ({hf['num_hidden_layers']} layers, random weights, "
             f"{dtype}), {gpu}", "", f"Command: `{command}`", "",
             f"FP8 kernel: {args.fp8_kernel}. {args.num_generations} responses of {args.response_length} tokens "
             "replayed against each capture; every figure against the capture of the same prompt without FP8. MFU: the "
             f"capture's forward FLOPs over its time, against the bf16 peak ({PEAK_TFLOPS:.0f} TFLOP/s).", "",
             "| prompt | chunk | variant | capture s | speed-up | MFU (bf16 peak) | last-position log-prob mean abs "
             "| replay loss rel. | replay gradient cosine |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['prompt_length']:,} | {row['chunk']:,} | bf16 | {row['bf16_capture_s']:.2f} | 1.00x "
                     f"| {row.get('bf16_mfu', float('nan')):.1%} | - | - | - |")
        variants = [("FP8 attention", row["fp8"])] + ([("FP8 emulation", row["emulation"])] if "emulation" in row else [])
        for name, v in variants:
            mfu = row.get("fp8_mfu_of_bf16_peak", float("nan")) if name == "FP8 attention" else float("nan")
            lines.append(f"| {row['prompt_length']:,} | {row['chunk']:,} | {name} | {v['capture_s']:.2f} "
                         f"| {row['bf16_capture_s'] / v['capture_s']:.2f}x | {mfu:.1%} | {v['logprob_mean_abs']:.2e} "
                         f"| {v['loss_rel_err']:.1e} | {v['cosine']:.4f} |")
    lines += ["", "The emulation's capture times are those of a torch emulation, not of a kernel."
              + (" The FP8 kernel here is the emulated one too: no time says anything." if args.fp8_kernel == "emulated" else "")]
    write_bench_files(args.output_dir, bench_stem("fp8_attention", _name(args), args.tag),
                      dict(command=command, gpu=gpu, rows=rows), lines)


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        raise SystemExit(f"error: {err}")
