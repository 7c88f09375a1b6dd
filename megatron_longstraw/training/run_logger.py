"""Console, ``metrics.jsonl`` and wandb logging of the trainer's metrics (rank 0 only).

wandb runs online with ``--wandb-project`` when credentials exist (``WANDB_API_KEY`` or a
``wandb login``), offline otherwise (``wandb sync`` uploads it later), or as ``--wandb-mode``
says. Where wandb is not installed (an offline GPU host) the console and ``metrics.jsonl``
still get every number, with one warning. A resumed run appends to the same wandb run id
(wandb ignores steps it already has: after a resume from an older checkpoint the redone steps
appear in ``metrics.jsonl``, rewritten from the checkpoint's step on, but not again in wandb).
"""

import json
import math
import os
import sys
from pathlib import Path

import torch

# metrics printed on the console line (every metric goes to wandb and metrics.jsonl)
CONSOLE_KEYS = ("reward/mean", "reward/std", "loss/policy", "clip/frac_low", "clip/frac_high", "kl/approx",
                "entropy/mean", "response/length_mean", "optim/grad_norm", "optim/lr", "time/step_s",
                "mem/peak_gib")


def _has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class RunLogger:
    """Logs one dict of floats per step; only rank 0 writes anything."""

    def __init__(self, args, config: dict, run_id: str | None = None, resume_step: int = 0):
        self.interval = args.log_interval
        self.rank0 = torch.distributed.get_rank() == 0
        self.wandb_run = None
        self.run_id = run_id
        if not self.rank0:
            return
        self.dir = Path(args.wandb_save_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._trim_jsonl(resume_step)
        self.jsonl = open(self.dir / "metrics.jsonl", "a")
        mode = args.wandb_mode or ("online" if args.wandb_project and _has_credentials() else "offline")
        if mode == "disabled":
            return
        try:
            import wandb
        except ImportError:
            print("warning: wandb is not installed; logging to the console and metrics.jsonl only",
                  file=sys.stderr)
            return
        self.wandb_run = wandb.init(
            project=args.wandb_project or "megatron-longstraw", name=args.wandb_exp_name, dir=str(self.dir),
            mode=mode, config=config, id=run_id, resume="allow" if run_id else None)
        self.run_id = self.wandb_run.id

    def _trim_jsonl(self, resume_step: int) -> None:
        """Drop rows of steps the resumed run will redo (logged after the checkpoint it loads)."""
        path = self.dir / "metrics.jsonl"
        if path.is_file():
            rows = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            path.write_text("".join(row + "\n" for row in rows))

    def log(self, step: int, metrics: dict) -> None:
        """Record ``metrics`` for optimizer step ``step`` (1-based)."""
        if not self.rank0:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self.jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(clean, step=step)
        if step % self.interval == 0:
            shown = " | ".join(f"{k} {clean[k]:.4g}" for k in CONSOLE_KEYS if k in clean and math.isfinite(clean[k]))
            print(f"step {step:5d} | {shown}", flush=True)

    def finish(self) -> None:
        """Close the run (flushes wandb's files)."""
        if self.rank0:
            self.jsonl.close()
            if self.wandb_run is not None:
                self.wandb_run.finish()
