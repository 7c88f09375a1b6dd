"""cuDNN's FP8 attention (``--fp8-attention capture``) call by call, at the shapes a long prompt's
capture gives it: accuracy against exact attention and speed, per key count, memory layout,
value distribution and query count; then the whole capture attention of one chunk over a long
prefix per page-block size, against exact attention and beside the bf16 capture attention.

Calls (``--keys``): one non-causal call of ``q`` queries (8 heads of 256 by default) over ``t``
keys (2 KV heads), E4M3 inputs at their scales. Its output (dequantized) is compared, on
``--rows`` query rows spread over the call, with exact attention of the same dequantized inputs,
beside the exact FP8 emulation's error on the same rows (``testing/fp8_attention_emulation.py``).
Layouts: ``bhsd`` (each head's keys contiguous) and ``bshd`` (the heads of a position together:
the layout the capture's pages ``[t, 1, groups, d]`` give when permuted). Values: ``zero-mean``
(standard normal) or ``common`` (``0.5 * randn`` plus one random vector per KV head: a model's
values share a direction, so the output sits near their mean and an error that mixes heads or
rescales the output shows at once).

Capture (``--pages``): ``fp8_capture_attention`` of a chunk of ``q`` queries over ``p`` pages (in
blocks of ``--prefix-blocks``) and itself, common values, against exact fp32 attention of the
same bf16 inputs on the sampled rows, with its time; the bf16 capture attention beside it.

    python tools/bench_fp8_attention_calls.py --output-dir docs/bench
"""

import argparse
import sys
import time

import torch

from megatron_longstraw.attention import fp8_capture_attention as fp8
from megatron_longstraw.attention.partials import expand_groups
from megatron_longstraw.attention.prefix_attention import prefix_causal_attention
from megatron_longstraw.config import cli
from megatron_longstraw.config.benchmark import BenchOutputConfig, TimingConfig
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.testing.exact_attention import exact_chunk_attention
from megatron_longstraw.testing.fp8_attention_emulation import emulated_sdpa_fp8
from bench_fp8_attention import comma_lengths  # tools/, beside this script
from bench_output import command_line, write_bench_files

LAYOUTS = ("bhsd", "bshd")
VALUES = ("zero-mean", "common")
CENTRES = ("none", "mean")


def _names(text: str, flag: str, allowed) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        raise ValueError(f"{flag} {text!r}: choose from {', '.join(allowed)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The tool's flags: the timing and output ones from the configuration (``config/``), its own."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA groups)")
    p.add_argument("--head-dim", type=int, default=256, help="head dim of queries, keys and values")
    p.add_argument("--queries", default="1024,32768", help="comma-separated query counts of the calls")
    p.add_argument("--keys", default="8192,65536,262144", help="comma-separated key counts of the calls")
    p.add_argument("--layouts", default="bhsd,bshd", help=f"comma-separated memory layouts: {', '.join(LAYOUTS)}")
    p.add_argument("--values", default="zero-mean,common", help=f"comma-separated value kinds: {', '.join(VALUES)}")
    p.add_argument("--centres", default="none,mean",
                   help="comma-separated value centrings of the calls: none, or mean (the call's mean value per KV "
                        "head subtracted before the cast and added back to the output, as the capture does)")
    p.add_argument("--pages", default="1048576", help="comma-separated page counts of the capture rows; empty for none")
    p.add_argument("--chunk-queries", default="1024,32768", help="comma-separated chunk lengths of the capture rows")
    p.add_argument("--prefix-blocks", default="16384,65536,262144",
                   help="comma-separated page-block sizes of the capture rows")
    p.add_argument("--rows", type=int, default=64, help="query rows compared with exact attention per call or chunk")
    cli.add_flags(p, TimingConfig)
    cli.add_flags(p, BenchOutputConfig)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    cli.group_from(args, TimingConfig)
    args.queries = comma_lengths(args.queries, "--queries")
    args.keys = comma_lengths(args.keys, "--keys")
    args.pages = comma_lengths(args.pages, "--pages")
    args.chunk_queries = comma_lengths(args.chunk_queries, "--chunk-queries")
    args.prefix_blocks = comma_lengths(args.prefix_blocks, "--prefix-blocks")
    args.layouts = _names(args.layouts, "--layouts", LAYOUTS)
    args.values = _names(args.values, "--values", VALUES)
    args.centres = _names(args.centres, "--centres", CENTRES)
    for flag in ("heads", "kv_heads", "head_dim", "rows"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def _timed(fn, repeats: int) -> tuple[object, float]:
    """``(fn(), mean seconds)`` over ``repeats`` timed calls after one warm-up."""
    result = fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    torch.cuda.synchronize()
    return result, (time.perf_counter() - start) / repeats


def _kernel_names(fn) -> list[str]:
    """The CUDA kernels one call of ``fn`` launches, by time spent (the attention kernel first)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return [e.key[:120] for e in sorted(events, key=lambda e: -getattr(e, "self_device_time_total", 0))[:3]]


def _sample_rows(count: int, rows: int) -> torch.Tensor:
    """``rows`` query rows spread over ``count`` (the first and the last among them)."""
    return torch.linspace(0, count - 1, min(rows, count)).round().long().unique()


def _values(gen, length: int, groups: int, dim: int, kind: str) -> torch.Tensor:
    """``[length, 1, groups, dim]`` bf16 values (module doc)."""
    if kind == "zero-mean":
        return torch.randn(length, 1, groups, dim, device="cuda", generator=gen).bfloat16()
    common = torch.randn(1, 1, groups, dim, device="cuda", generator=gen)
    return (0.5 * torch.randn(length, 1, groups, dim, device="cuda", generator=gen) + common).bfloat16()


def _to_layout(x_SBGD: torch.Tensor, layout: str) -> torch.Tensor:
    """``[b, heads, s, d]`` of a ``[s, b, heads, d]`` tensor in the given memory layout."""
    x = x_SBGD.permute(1, 2, 0, 3)
    return x.contiguous() if layout == "bhsd" else x


def _cast_keeping_layout(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.cast_fp8``'s scale and cast, in ``x``'s own memory layout (``cast_fp8`` writes
    contiguous ``[b, heads, s, d]``)."""
    scale = fp8.pow2_scale(x.abs().amax())
    return (x * scale.to(x.dtype)).to(torch.float8_e4m3fn), (1.0 / scale).reshape(1, 1, 1, 1)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def call_row(args, queries: int, keys: int, layout: str, kind: str, centre: str) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(queries + keys)
    q = _to_layout(torch.randn(queries, 1, args.heads, args.head_dim, device="cuda", generator=gen).bfloat16(), layout)
    k = _to_layout(torch.randn(keys, 1, args.kv_heads, args.head_dim, device="cuda", generator=gen).bfloat16(), layout)
    v = _to_layout(_values(gen, keys, args.kv_heads, args.head_dim, kind), layout)
    mean = torch.zeros_like(v[:, :, :1])
    if centre == "mean":
        mean = v.mean(dim=2, keepdim=True, dtype=torch.float32).bfloat16()
        v = v - mean
        v = v.contiguous() if layout == "bhsd" else v.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    mean = expand_groups(mean.float(), args.heads)
    (q8, dq), (k8, dk), (v8, dv) = _cast_keeping_layout(q), _cast_keeping_layout(k), _cast_keeping_layout(v)
    del q, k, v
    assert all(x.is_contiguous() == (layout == "bhsd") for x in (q8, k8, v8)), "the layout kept"
    scale_s = torch.full((1, 1, 1, 1), fp8.P_SCALE, device="cuda")
    scale_o = 0.5 / dv
    call_args = (dq, dk, dv, scale_s, scale_o, args.head_dim ** -0.5, False)
    (out8, lse), seconds = _timed(lambda: fp8.cudnn_sdpa_fp8(q8, k8, v8, *call_args), args.repeats)
    names = _kernel_names(lambda: fp8.cudnn_sdpa_fp8(q8, k8, v8, *call_args))
    rows = _sample_rows(queries, args.rows).cuda()
    q8_rows = q8[:, :, rows]
    exact, exact_lse = emulated_sdpa_fp8(q8_rows.float(), k8.float(), v8.float(), *call_args)  # fp32 "FP8": exact casts
    emulated, _ = emulated_sdpa_fp8(q8_rows, k8, v8, *call_args)
    # each output with the mean added back (zero when not centred), dequantized at scale_o
    exact, emulated, got = (x.float() / scale_o + mean for x in (exact, emulated, out8[:, :, rows]))
    flops = 4 * queries * keys * args.heads * args.head_dim
    return dict(queries=queries, keys=keys, layout=layout, values=kind, centre=centre, ms=seconds * 1e3,
                tflops=flops / seconds / 1e12, kernel_rel_err=_rel(got, exact), emulation_rel_err=_rel(emulated.float(), exact),
                lse_max_abs=(lse[:, :, rows].double() - exact_lse.double()).abs().max().item(), kernels=names)


def capture_row(args, queries: int, pages: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(pages + queries)
    q = torch.randn(queries, 1, args.heads, args.head_dim, device="cuda", generator=gen).bfloat16()
    k_all = torch.randn(pages + queries, 1, args.kv_heads, args.head_dim, device="cuda", generator=gen).bfloat16()
    v_all = _values(gen, pages + queries, args.kv_heads, args.head_dim, "common")
    pk, pv, k, v = k_all[:pages], v_all[:pages], k_all[pages:], v_all[pages:]
    rows = _sample_rows(queries, args.rows)
    exact = exact_chunk_attention(q, k, v, pk, pv, rows=rows.tolist())
    flops = 4 * queries * pages * args.heads * args.head_dim + 2 * queries * queries * args.heads * args.head_dim
    out = []
    for block in args.prefix_blocks:
        options = KernelOptions(prefix_block=block)
        got, seconds = _timed(lambda: fp8.fp8_capture_attention(q, k, v, pk, pv, options=options), args.repeats)
        out.append(dict(queries=queries, pages=pages, prefix_block=block, variant="fp8", ms=seconds * 1e3,
                        tflops=flops / seconds / 1e12, rel_err=_rel(got[rows.cuda()].float(), exact)))
    with torch.no_grad():
        options = KernelOptions()
        got, seconds = _timed(lambda: prefix_causal_attention(q, k, v, pk, pv, options=options), args.repeats)
    out.append(dict(queries=queries, pages=pages, prefix_block=options.prefix_block, variant="bf16", ms=seconds * 1e3,
                    tflops=flops / seconds / 1e12, rel_err=_rel(got[rows.cuda()].float(), exact)))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    command = command_line(argv)
    fp8.check_supported([args.head_dim], torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    gpu = torch.cuda.get_device_name()
    calls, captures = [], []

    def report():
        lines = [f"# cuDNN FP8 attention by call: {args.heads} query / {args.kv_heads} KV heads of {args.head_dim}, "
                 f"{gpu}", "", f"Command: `{command}`", "",
                 f"Errors: relative norm against exact attention on {args.rows} query rows spread over the call; "
                 "TFLOP/s of the call's time (mean of the timed repeats).", "",
                 "| queries | keys | layout | values | centred | ms | TFLOP/s | kernel rel. err | emulation rel. err "
                 "| lse max abs | top kernel |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['queries']:,} | {r['keys']:,} | {r['layout']} | {r['values']} | {r['centre']} | {r['ms']:.2f} "
                  f"| {r['tflops']:.0f} "
                  f"| {r['kernel_rel_err']:.3e} | {r['emulation_rel_err']:.3e} | {r['lse_max_abs']:.1e} "
                  f"| `{r['kernels'][0] if r['kernels'] else '-'}` |" for r in calls]
        if captures:
            lines += ["", "Whole capture attention of one chunk (pages in blocks, the chunk causal, merged), common "
                      "values, against exact fp32 attention of the bf16 inputs:", "",
                      "| chunk queries | pages | variant | page block | ms | TFLOP/s | rel. err |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {r['queries']:,} | {r['pages']:,} | {r['variant']} | {r['prefix_block']:,} | {r['ms']:.1f} "
                      f"| {r['tflops']:.0f} | {r['rel_err']:.3e} |" for r in captures]
        tag = f"_{args.tag}" if args.tag else ""
        write_bench_files(args.output_dir, f"fp8_attention_calls{tag}", dict(command=command, gpu=gpu, calls=calls,
                                                                             captures=captures), lines)
        return lines

    for queries in args.queries:
        for keys in args.keys:
            for layout in args.layouts:
                for kind, centre in ((kind, centre) for kind in args.values for centre in args.centres):
                    calls.append(call_row(args, queries, keys, layout, kind, centre))
                    r = calls[-1]
                    print(f"call q {queries} k {keys} {layout} {kind} centre {centre}: {r['ms']:.2f} ms "
                          f"{r['tflops']:.0f} TFLOP/s, "
                          f"kernel {r['kernel_rel_err']:.3e} emulation {r['emulation_rel_err']:.3e} "
                          f"lse {r['lse_max_abs']:.1e} {r['kernels'][:1]}", flush=True)
                    torch.cuda.empty_cache()
            report()
    for pages in args.pages:
        for queries in args.chunk_queries:
            captures.extend(capture_row(args, queries, pages))
            for r in captures[-len(args.prefix_blocks) - 1:]:
                print(f"capture q {queries} pages {pages} {r['variant']} block {r['prefix_block']}: {r['ms']:.1f} ms "
                      f"{r['tflops']:.0f} TFLOP/s rel err {r['rel_err']:.3e}", flush=True)
            torch.cuda.empty_cache()
            report()
    print("\n".join(report()))


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        raise SystemExit(f"error: {err}")
