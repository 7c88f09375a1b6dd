"""Plot a trainer run's metrics (``metrics.jsonl``) against the step, e.g. the learning curve.

    python tools/plot_metrics.py runs/grpo-demo/metrics.jsonl --keys reward/mean \\
        --output docs/learning_curve.png --title "command that made the run"

Each key is drawn raw and as a moving average (``--window`` steps); a markdown table of the
first and last window's means goes to stdout.
"""

import argparse
import json
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    """The rows of ``metrics.jsonl``; ``ValueError`` naming the file and line for a bad one."""
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", type=Path)
    p.add_argument("--keys", default="reward/mean")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    rows = read_rows(args.metrics)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in args.keys.split(",") if k]
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    print("| metric | first window mean | last window mean |\n| --- | --- | --- |")
    for ax, key in zip(axes[0], keys):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if not points:
            raise ValueError(f"--keys: {args.metrics} has no metric {key!r}")
        steps, values = zip(*points)
        smooth = moving_average(list(values), args.window)
        ax.plot(steps, values, alpha=0.35, label=key)
        ax.plot(steps, smooth, label=f"{key} ({args.window}-step mean)")
        ax.set_xlabel("step")
        ax.legend()
        head = values[: args.window]
        print(f"| {key} | {sum(head) / len(head):.4f} | {smooth[-1]:.4f} |")
    fig.suptitle(args.title, fontsize=7)
    fig.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        raise SystemExit(f"error: {err}")
