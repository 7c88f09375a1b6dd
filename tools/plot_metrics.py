"""Plot trainer runs' metrics (``metrics.jsonl``) against the step, e.g. learning curves side by side.

    python tools/plot_metrics.py runs/grpo-demo/metrics.jsonl --keys reward/mean \\
        --output docs/learning_curve.png --title "command that made the run"
    python tools/plot_metrics.py exact=runs/exact/metrics.jsonl detached=runs/detached/metrics.jsonl \\
        --keys reward/mean,eval/greedy_reward --hline "0.333:format ceiling" --output docs/learning.png

Each run (``LABEL=PATH``, or a path labelled by its folder) is drawn on one axis per key, raw and
as a moving average (``--window`` steps; metrics logged every N steps, such as ``eval/*``, are
drawn as points joined by lines); ``--hline VALUE:LABEL`` draws a reference level on every axis.
A markdown table of each run's first and last window means goes to stdout.
"""

import argparse
import json
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    """The rows of ``metrics.jsonl``; ``ValueError`` naming the file and line for a bad one."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from err
    if not rows:
        raise ValueError(f"{path}: no metrics rows")
    return rows


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def parse_run(text: str) -> tuple[str, Path]:
    """``LABEL=PATH`` or ``PATH`` (labelled by its folder's name)."""
    label, sep, path = text.partition("=")
    if not sep or "/" in label or Path(text).is_file():  # a path that holds "=" is a path
        path = text
        label = Path(text).parent.name or Path(text).stem
    return label, Path(path)


def parse_hline(text: str) -> tuple[float, str]:
    """``VALUE:LABEL``; ``ValueError`` naming the flag for a value that is not a number."""
    value, _, label = text.partition(":")
    try:
        return float(value), label
    except ValueError:
        raise ValueError(f"--hline {text!r}: expected VALUE:LABEL with a number VALUE") from None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="metrics.jsonl files, each PATH or LABEL=PATH")
    p.add_argument("--keys", default="reward/mean", help="comma-separated metrics, one axis each")
    p.add_argument("--window", type=int, default=10, help="steps of the moving average")
    p.add_argument("--hline", action="append", default=[], metavar="VALUE:LABEL",
                   help="a reference level drawn on every axis (repeatable)")
    p.add_argument("--output", type=Path, required=True, help="the PNG to write")
    p.add_argument("--title", default="", help="the figure's title (e.g. the commands of the runs)")
    args = p.parse_args(argv)
    if args.window < 1:
        raise ValueError(f"--window must be >= 1, got {args.window}")
    runs = [(label, read_rows(path), path) for label, path in map(parse_run, args.runs)]
    levels = [parse_hline(h) for h in args.hline]
    keys = [k for k in args.keys.split(",") if k]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    print("| run | metric | first window mean | last window mean |\n| --- | --- | --- | --- |")
    for ax, key in zip(axes[0], keys):
        for label, rows, path in runs:
            points = [(r["step"], r[key]) for r in rows if key in r]
            if not points:
                raise ValueError(f"--keys: {path} has no metric {key!r}")
            steps, values = zip(*points)
            window = args.window if len(points) == len(rows) else 1  # a metric of every step, or of some
            smooth = moving_average(list(values), window)
            name = f"{label}: {key}" if len(runs) > 1 else key
            if window > 1:
                ax.plot(steps, values, alpha=0.25)
                ax.plot(steps, smooth, color=ax.lines[-1].get_color(), label=f"{name} ({window}-step mean)")
            else:
                ax.plot(steps, values, marker="o", markersize=3, label=name)
            head = values[:window]
            print(f"| {label} | {key} | {sum(head) / len(head):.4f} | {smooth[-1]:.4f} |")
        for value, text in levels:
            ax.axhline(value, color="gray", linestyle="--", linewidth=1, label=text or None)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.suptitle(args.title, fontsize=7)
    fig.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    partial = args.output.with_name(args.output.name + ".partial")
    fig.savefig(partial, dpi=110, format="png")
    partial.replace(args.output)  # never a half-written figure in place of an earlier one


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        raise SystemExit(f"error: {err}")
