"""How far FP8 GEMM numerics move a model's LongStraw replay gradients, measured without
Transformer Engine: the local-spec model in fp32 on CPU (or GPU), its linear layers switched to
emulated FP8 (``testing/fp8_emulation.py``), or its capture's attention
(``testing/fp8_attention_emulation.py``: what an FP8 attention in the capture does to the numerics;
models without a full-attention core skip that variant),
against the same model without FP8.

Every variant captures the same prompt and replays the same G responses with the loss of the
GPU FP8 test (``-sum(logprobs) / response tokens``) and reports the loss's relative error, the
whole-model gradient cosine, the parameters that pull it down, and how far the log-probabilities
after the prompt (from the capture alone) move. A forward of one response
reports how the relative error of the hidden states grows layer by layer under FP8. If the
emulation's cosine is as low as Transformer Engine's, the low cosine is FP8's own effect on the
model; if TE's is lower, TE adds an error of its own.

    python tools/fp8_sensitivity.py --model qwen3.5-0.8b --prompt-length 1024 --response-length 256 \\
        --num-generations 2 --prompt-chunk-size 1024
"""

import argparse
import sys
import time

from megatron_longstraw.config import cli
from megatron_longstraw.config.benchmark import BenchOutputConfig
from megatron_longstraw.config.grpo import GRPOConfig
from megatron_longstraw.config.longstraw import LongStrawConfig
from megatron_longstraw.config.model import ModelConfig
from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.config.workload import WorkloadConfig


def build_parser() -> argparse.ArgumentParser:
    """The tool's flags, all shared ones from the configuration (``config/``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_flags(p, ModelConfig, only=("model", "num_layers"))
    cli.add_flags(p, WorkloadConfig, only=("prompt_length", "response_length"))
    cli.add_flags(p, GRPOConfig, only=("num_generations",))
    cli.add_flags(p, LongStrawConfig, only=("prompt_chunk_size",))
    cli.add_flags(p, BenchOutputConfig)
    return p


if __name__ == "__main__":
    build_parser().parse_args()  # --help and a bad flag answer before torch and Megatron load

import torch  # noqa: E402

from megatron_longstraw.attention.sdpa_core import SDPACoreAttention  # noqa: E402
from megatron_longstraw.checkpointing.model_checkpoint import model_hf_config  # noqa: E402
from megatron_longstraw.distributed import destroy_distributed, device, init_distributed  # noqa: E402
from megatron_longstraw.longstraw.capture import capture_prompt  # noqa: E402
from megatron_longstraw.models.builder import build_model  # noqa: E402
from megatron_longstraw.models.options import ModelOptions  # noqa: E402
from megatron_longstraw.rollout.generate import full_vocab_logits  # noqa: E402
from megatron_longstraw.testing.fp8_attention_emulation import emulated_fp8_capture_attention  # noqa: E402
from megatron_longstraw.testing.fp8_emulation import emulated_fp8_linears, switched_linears  # noqa: E402
from megatron_longstraw.testing.parity import replay_gradients  # noqa: E402
from bench_output import bench_stem, command_line, write_bench_files  # noqa: E402 (tools/, beside this script)

VARIANTS = {  # name: (recipe, passes); "bf16" rounds the same GEMM operands to bf16 instead
    "fp8 tensorwise": ("tensorwise", "both"),
    "fp8 delayed": ("delayed", "both"),
    "fp8 tensorwise, forward only": ("tensorwise", "forward"),
    "fp8 tensorwise, backward only": ("tensorwise", "backward"),
    "bf16 GEMM operands": None,
    "fp8 attention in capture": "attention",  # the capture's attention, emulated; GEMMs exact
}


def parse_args(argv=None) -> argparse.Namespace:
    """The tool's flags, checked by their configuration groups."""
    args = build_parser().parse_args(argv)
    for group in (ModelConfig, WorkloadConfig, GRPOConfig, LongStrawConfig):
        cli.group_from(args, group)
    return args


def bf16_linears(model):
    """The same linear layers as ``emulated_fp8_linears``, their inputs and weights rounded to
    bf16 and so the gradients flowing back to them: the precision the FP8 test compares
    against, for scale."""
    class Round(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.to(torch.bfloat16).to(t.dtype)

        @staticmethod
        def backward(ctx, g):
            return g.to(torch.bfloat16).to(g.dtype)

    def forward_impl(input, weight, bias=None, **_):
        out = Round.apply(input) @ Round.apply(weight).t()
        return out if bias is None else out + bias

    return switched_linears(model, lambda: forward_impl)


def switch_for(model, spec):
    """The context that applies a ``VARIANTS`` entry to ``model``."""
    if spec is None:
        return bf16_linears(model)
    if spec == "attention":
        return emulated_fp8_capture_attention(model)
    return emulated_fp8_linears(model, *spec)


@torch.no_grad()
def last_logprobs(model, prompt_1S, chunk_size: int) -> torch.Tensor:
    """The log-probabilities after the prompt (the first sampled token's), from one capture."""
    state = capture_prompt(model, prompt_1S, chunk_size)
    try:
        return full_vocab_logits(model, state.last_logits_BV).log_softmax(-1)
    finally:
        state.free()


def compare(reference, measured):
    """Whole-model cosine, and per parameter (cosine, share of the reference's squared norm)."""
    (loss0, g0), (loss1, g1) = reference, measured
    assert g0.keys() == g1.keys()
    sq0 = {n: torch.dot(g, g).item() for n, g in g0.items()}
    sq1 = {n: torch.dot(g, g).item() for n, g in g1.items()}
    dots = {n: torch.dot(g1[n], g0[n]).item() for n in g0}
    cosine = sum(dots.values()) / (sum(sq0.values()) * sum(sq1.values())) ** 0.5
    total = sum(sq0.values())
    per_param = {n: (dots[n] / max(sq0[n] * sq1[n], 1e-300) ** 0.5, sq0[n] / total) for n in g0}
    return dict(loss_rel_err=abs(loss1 - loss0) / abs(loss0), cosine=cosine, per_param=per_param)


def layer_errors(model, tokens_1S):
    """Relative error of each decoder layer's output (and the final norm's) under FP8
    tensorwise, one forward of ``tokens_1S``."""
    outputs = {}
    modules = {f"layer {i}": layer for i, layer in enumerate(model.decoder.layers)}
    modules["final norm"] = model.decoder.final_layernorm
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: outputs.setdefault(name, []).append(
        (o[0] if isinstance(o, tuple) else o).detach().clone())) for name, m in modules.items()]
    with torch.no_grad():
        model(tokens_1S, None, None)
        with emulated_fp8_linears(model):
            model(tokens_1S, None, None)
    for hook in hooks:
        hook.remove()
    return {name: ((b - a).norm() / a.norm()).item() for name, (a, b) in outputs.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    command = command_line(argv)
    init_distributed(ParallelSizes(), seed=1234)
    try:
        hf = model_hf_config(cli.group_from(args, ModelConfig))
        torch.manual_seed(0)
        model = build_model(hf, ModelOptions())
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, hf["vocab_size"], (1, args.prompt_length), generator=gen).to(device())
        responses = [torch.randint(0, hf["vocab_size"], (args.response_length,), generator=gen).to(device())
                     for _ in range(args.num_generations)]
        start = time.time()
        reference = replay_gradients(model, prompt, responses, args.prompt_chunk_size)
        reference_logprobs = last_logprobs(model, prompt, args.prompt_chunk_size)
        rows = {}
        has_attention = any(isinstance(m, SDPACoreAttention) for m in model.modules())
        for name, spec in VARIANTS.items():
            if spec == "attention" and not has_attention:  # e.g. GLM-5: DSA/MLA, no full-attention core
                continue
            with switch_for(model, spec):
                rows[name] = compare(reference, replay_gradients(model, prompt, responses, args.prompt_chunk_size))
                rows[name]["logprob_abs_diff"] = (last_logprobs(model, prompt, args.prompt_chunk_size)
                                                  - reference_logprobs).abs().mean().item()
            print(f"{name}: cosine {rows[name]['cosine']:.4f}", flush=True)
        layers = layer_errors(model, responses[0][None])
        seconds = time.time() - start
    finally:
        destroy_distributed()
    write_report(args, command, hf, rows, layers, seconds)


def write_report(args, command, hf, rows, layers, seconds) -> None:
    model_name = cli.group_from(args, ModelConfig).name
    lines = [f"# FP8 sensitivity of {model_name} ({hf['num_hidden_layers']} layers, random weights), emulated", "",
             f"Command: `{command}` ({seconds:.0f} s)", "",
             f"Prompt {args.prompt_length} tokens, {args.num_generations} responses of {args.response_length}; "
             "reference: the same model without rounding, fp32.", "",
             "| variant | loss rel. error | gradient cosine | last-position log-prob mean abs. diff "
             "| weakest large parameter (cosine, share of grad norm) |",
             "| --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        params = [(c, w, n) for n, (c, w) in row["per_param"].items()]
        c, w, n = min([p for p in params if p[1] >= 0.01] or params)
        lines.append(f"| {name} | {row['loss_rel_err']:.1e} | {row['cosine']:.4f} | {row['logprob_abs_diff']:.1e} "
                     f"| `{n}` {c:.3f}, {w:.0%} |")
    shown = [k for k in layers if k == "final norm" or int(k.split()[1]) % 4 == 0 or k == f"layer {len(layers) - 2}"]
    lines += ["", "Hidden-state relative error after each layer, FP8 tensorwise, one forward of a response:", "",
              "| " + " | ".join(shown) + " |", "|" + " --- |" * len(shown),
              "| " + " | ".join(f"{layers[k]:.3f}" for k in shown) + " |"]
    summary = {name: {k: v for k, v in row.items() if k != "per_param"} for name, row in rows.items()}
    record = dict(command=command, variants=summary, layer_rel_err=layers,
                  per_param={name: row["per_param"] for name, row in rows.items()})
    write_bench_files(args.output_dir, bench_stem("fp8_sensitivity", model_name, args.tag), record, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        raise SystemExit(f"error: {err}")
