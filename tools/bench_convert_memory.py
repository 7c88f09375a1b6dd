"""Measure the peak host memory of tools/convert_checkpoint.py on a synthetic checkpoint.

Builds a random Qwen3.5-shaped HF checkpoint (fp32, several safetensors shards; generated
tensor by tensor, so this script never holds the model either) in a temporary folder, then
runs hf-to-mcore and mcore-to-hf, each in a fresh subprocess, and reads each subprocess's peak
resident memory (``ru_maxrss`` = ``VmHWM``, file-mapped pages included). The fixed overhead is
the peak of the same two conversions of the tiny ``qwen3.5-debug`` model (Python, torch,
Megatron, the meta model) plus ``MAX_CHUNK_BYTES`` (64 MiB: one checkpoint piece in flight,
which the tiny model's tensors never reach). The check: peak <= 2 x largest tensor + overhead.

Example:
    python tools/bench_convert_memory.py --hidden-size 2048 --ffn-hidden-size 8192 \\
        --vocab-size 65536 --num-hidden-layers 4 --output docs/convert_memory.md
"""

import argparse
import copy
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from megatron_longstraw.checkpointing.convert import MAX_CHUNK_BYTES
from megatron_longstraw.checkpointing.safetensors_io import SafetensorsWriter
from megatron_longstraw.models.qwen3_5.presets import PRESETS
from bench_output import command_line  # tools/, beside this script

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
_RUN = ("import resource, runpy, sys; sys.argv = sys.argv[1:]\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")


def synthetic_config(args) -> dict:
    """A Qwen3.5 text config with the requested sizes (3 GDN layers per attention layer)."""
    hf = copy.deepcopy(PRESETS["qwen3.5-debug"])
    hf.update(hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
              vocab_size=args.vocab_size, num_hidden_layers=args.num_hidden_layers,
              layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                           for i in range(args.num_hidden_layers)],
              num_attention_heads=16, num_key_value_heads=4, head_dim=128,
              linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
              linear_value_head_dim=128, tie_word_embeddings=False)
    return hf


def hf_tensor_specs(hf: dict) -> list[tuple[str, torch.dtype, tuple]]:
    """HF checkpoint names and shapes of the model (from its Megatron layout, on meta)."""
    from megatron_longstraw.checkpointing.convert import _single_process
    from megatron_longstraw.checkpointing.layout import model_layout
    from megatron_longstraw.models.registry import family_for

    family = family_for(hf["model_type"])
    with _single_process():
        layout = model_layout(hf)
    specs = []
    for weight, shape in layout.params.items():
        out = family.weights.mcore_to_hf({weight: torch.empty(shape, device="meta")}, hf,
                                         checkpoint_layout=True)
        specs += [(name, torch.float32, tuple(t.shape)) for name, t in out.items()]
    return specs


def write_synthetic(folder: Path, hf: dict, shard_bytes: int) -> tuple[int, int, int]:
    """Random HF folder; returns (total bytes, largest tensor bytes, shards)."""
    folder.mkdir(parents=True)
    specs = hf_tensor_specs(hf)
    sizes = [torch.Size(s).numel() * 4 for _, _, s in specs]
    shards, current, used = [], [], 0
    for spec, size in zip(specs, sizes):
        if current and used + size > shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(spec)
        used += size
    shards.append(current)
    weight_map = {}
    generator = torch.Generator().manual_seed(0)
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsWriter(folder / file, shard)
        for name, dtype, shape in shard:
            writer.add(name, torch.randn(shape, generator=generator, dtype=dtype) * 0.02)
            weight_map[name] = file
        writer.close()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(
        {k: v for k, v in hf.items() if not k.startswith("_")}))
    return sum(sizes), max(sizes), len(shards)


def peak_kib(*tool_args) -> int:
    """Peak RSS (KiB) of one tools/convert_checkpoint.py run in a fresh process."""
    result = subprocess.run([sys.executable, "-c", _RUN, str(ROOT / "tools" / "convert_checkpoint.py"),
                             *tool_args, "--no-progress"], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return int(result.stdout.split("PEAK_KB")[-1].split()[0])


def convert_both(hf_folder: Path, work: Path, shard: str) -> tuple[int, int]:
    """Peak KiB of hf-to-mcore and of mcore-to-hf."""
    work.mkdir(exist_ok=True)
    up = peak_kib("hf-to-mcore", "--load", str(hf_folder), "--save", str(work / "mcore"))
    down = peak_kib("mcore-to-hf", "--load", str(work / "mcore"), "--save", str(work / "back"),
                    "--max-shard-size", shard)
    return up, down


def build_parser() -> argparse.ArgumentParser:
    """The tool's flags (its own: the synthetic checkpoint's sizes)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("synthetic checkpoint", "the HF config fields of the checkpoint it converts")
    g.add_argument("--hidden-size", type=int, default=2048, help="hidden_size (default: 2048)")
    g.add_argument("--ffn-hidden-size", type=int, default=8192, help="intermediate_size (default: 8192)")
    g.add_argument("--vocab-size", type=int, default=65536, help="vocab_size (default: 65536)")
    g.add_argument("--num-hidden-layers", type=int, default=4,
                   help="num_hidden_layers, every fourth full attention (default: 4)")
    g.add_argument("--shard-size-mb", type=int, default=400, help="safetensors shard size in MiB (default: 400)")
    p.add_argument("--workdir", default=None, help="temporary folder (default: system temp)")
    p.add_argument("--output", default=None, help="write the markdown report here")
    return p


def main(argv=None) -> dict:
    """Run the benchmark; prints (and optionally writes) a markdown report."""
    args = build_parser().parse_args(argv)
    command = command_line(argv)
    work = Path(tempfile.mkdtemp(dir=args.workdir, prefix="bench_convert_"))
    try:
        tiny = copy.deepcopy(PRESETS["qwen3.5-debug"])
        write_synthetic(work / "tiny_hf", tiny, 2**30)
        base_up, base_down = convert_both(work / "tiny_hf", work / "tiny", "1GB")
        hf = synthetic_config(args)
        total, largest, shards = write_synthetic(work / "hf", hf, args.shard_size_mb * MiB)
        up, down = convert_both(work / "hf", work, f"{args.shard_size_mb}MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    result = dict(total_mib=total / MiB, largest_mib=largest / MiB, shards=shards)
    for name, peak, base in (("hf-to-mcore", up, base_up), ("mcore-to-hf", down, base_down)):
        base += MAX_CHUNK_BYTES // 1024
        bound = 2 * largest / MiB + base / 1024
        result[name] = dict(peak_mib=peak / 1024, overhead_mib=base / 1024, bound_mib=bound,
                            ok=peak / 1024 <= bound)
        rows.append(f"| {name} | {peak / 1024:.0f} | {base / 1024:.0f} | {bound:.0f} | "
                    f"{(peak - base) / 1024 / (largest / MiB):.2f} | {'yes' if peak / 1024 <= bound else 'NO'} |")
    report = "\n".join([
        "# Peak host memory of tools/convert_checkpoint.py", "",
        f"Command: `{command}`", "",
        f"Synthetic Qwen3.5-shaped fp32 checkpoint: {total / MiB:.0f} MiB in {shards} shards, "
        f"largest tensor {largest / MiB:.0f} MiB (the embedding / lm_head). Peak = `ru_maxrss` "
        "(VmHWM) of the conversion subprocess; overhead = peak of the same conversion of the tiny "
        "`qwen3.5-debug` model (interpreter, torch, Megatron, meta model) + 64 MiB "
        "(`MAX_CHUNK_BYTES`: one checkpoint piece in flight).", "",
        "| direction | peak MiB | overhead MiB | bound 2 x largest + overhead MiB | "
        "(peak - overhead) / largest | within bound |",
        "|---|---|---|---|---|---|", *rows, ""])
    print(report)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(report)
    return result


if __name__ == "__main__":
    main()
