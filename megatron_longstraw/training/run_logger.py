"""Console, ``metrics.jsonl`` and wandb logging of the trainer's metrics (rank 0 only).

wandb runs online with ``--wandb-project`` when credentials exist (``WANDB_API_KEY`` or a
``wandb login``), offline otherwise (``wandb sync`` uploads it later), or as ``--wandb-mode``
says. Where wandb is not installed (an offline GPU host) the console and ``metrics.jsonl``
still get every number, with one warning. A resumed run appends to the same wandb run id
(wandb ignores steps it already has: after a resume from an older checkpoint the redone steps
appear in ``metrics.jsonl``, rewritten from the checkpoint's step on, but not again in wandb).

``metrics.jsonl`` is only touched when the first step is logged: a resumed run appends to it
(after dropping the rows of the steps it redoes, replacing the file atomically and keeping the
file as it was as ``metrics.jsonl.N``); a fresh run into a run folder that has rows
(``--overwrite``) first keeps the earlier run's file as ``metrics.jsonl.N``. A truncated last line (a crash mid-write) is dropped with a warning.
"""

import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from megatron_longstraw.config.training import LoggingConfig

METRICS_NAME = "metrics.jsonl"

# metrics printed on the console line (every metric goes to wandb and metrics.jsonl)
CONSOLE_KEYS = ("reward/mean", "reward/std", "loss/policy", "clip/frac_low", "clip/frac_high", "kl/approx",
                "entropy/mean", "response/length_mean", "optim/grad_norm", "optim/lr", "time/step_s",
                "mem/peak_gib")


def _has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def read_metrics_rows(path: Path) -> list[tuple[int, str]]:
    """``(step, line)`` of each row of a ``metrics.jsonl``. A last line without its newline that
    does not parse (a crash mid-write) is dropped with one warning; any other line that is not a
    JSON object with an integer ``step`` is a ``ValueError`` naming the file and line."""
    lines = path.read_text(errors="replace").split("\n")  # the last piece: "" or an unterminated line
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problem = None if isinstance(row, dict) and type(row.get("step")) is int else 'no integer "step"'
        except ValueError as err:
            problem = getattr(err, "msg", str(err))
        if problem is None:
            rows.append((row["step"], line))
        elif number == len(lines):
            print(f"warning: {path}: dropped its truncated last line {number} (a crash mid-write)", file=sys.stderr)
        else:
            raise ValueError(f"{path} line {number}: not a metrics row ({problem})")
    return rows


def has_rows(path: Path) -> bool:
    """Whether ``path`` exists with anything but whitespace in it (an earlier run's metrics)."""
    return path.is_file() and path.stat().st_size > 0 and bool(path.read_text(errors="replace").strip())


class RunLogger:
    """Logs one dict of floats per step; only rank 0 writes anything."""

    def __init__(self, logging: LoggingConfig, train_iters: int, config: dict, run_id: str | None = None,
                 resume_step: int = 0):
        self.interval = logging.log_interval
        # the ETA: this run's mean pace from its first step on (the model built, a checkpoint loaded), saves included
        self.train_iters, self.start_step, self.start_time = train_iters, resume_step, time.perf_counter()
        self.rank0 = torch.distributed.get_rank() == 0
        self.wandb_run = None
        self.run_id = run_id
        if not self.rank0:
            return
        self.dir = Path(logging.wandb_save_dir)
        self.path = self.dir / METRICS_NAME
        self.resume_step = resume_step
        self.jsonl = None
        # a resumed run's rows are checked up front; a fresh run only sets the earlier file aside
        self.earlier_rows = read_metrics_rows(self.path) if resume_step > 0 and self.path.is_file() else None
        self.dir.mkdir(parents=True, exist_ok=True)
        mode = logging.wandb_mode or ("online" if logging.wandb_project and _has_credentials() else "offline")
        if mode == "disabled":
            return
        try:
            import wandb
        except ImportError:
            print("warning: wandb is not installed; logging to the console and metrics.jsonl only",
                  file=sys.stderr)
            return
        self.wandb_run = wandb.init(
            project=logging.wandb_project or "megatron-longstraw", name=logging.wandb_exp_name, dir=str(self.dir),
            mode=mode, config=config, id=run_id, resume="allow" if run_id else None,
            settings=wandb.Settings(quiet=True))  # where the run is and how to sync it; no end-of-run tables
        self.run_id = self.wandb_run.id

    def _open_jsonl(self) -> None:
        """Open ``metrics.jsonl`` for appending, at the first logged step (module doc): a fresh
        run keeps an earlier run's file as ``metrics.jsonl.N``; a resumed one keeps the rows up to
        its checkpoint's step, rewriting the file (write + ``os.replace``) only if that drops any."""
        if self.resume_step == 0 and has_rows(self.path):
            print(f"{self.path}: the earlier run's metrics are kept as {self._set_aside()}", flush=True)
        elif self.earlier_rows is not None and self.path.is_file():
            if self.resume_step not in {step for step, _ in self.earlier_rows}:
                print(f"warning: {self.path} has no row of step {self.resume_step}, the checkpoint's (the run "
                      "stopped between that save and its row)", file=sys.stderr, flush=True)
            text = "".join(line + "\n" for step, line in self.earlier_rows if step <= self.resume_step)
            if text != self.path.read_text(errors="replace"):  # rows after the checkpoint's step
                partial = self.path.with_name(METRICS_NAME + ".tmp")
                partial.write_text(text)
                kept = self._set_aside()  # the file as it was, whole
                os.replace(partial, self.path)
                print(f"{self.path}: the rows after step {self.resume_step} (this run writes them again) "
                      f"are kept in {kept}", flush=True)
        self.jsonl = open(self.path, "a")

    def _set_aside(self) -> Path:
        """Rename ``metrics.jsonl`` to the first free ``metrics.jsonl.N``; returns that path."""
        number = 1
        while self.path.with_name(f"{METRICS_NAME}.{number}").exists():
            number += 1
        kept = self.path.with_name(f"{METRICS_NAME}.{number}")
        os.rename(self.path, kept)
        return kept

    def log(self, step: int, metrics: dict) -> None:
        """Record ``metrics`` for optimizer step ``step`` (1-based)."""
        if not self.rank0:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        if self.jsonl is None:
            self._open_jsonl()
        self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self.jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(clean, step=step)
        if step % self.interval == 0:
            shown = " | ".join(f"{k} {clean[k]:.4g}" for k in CONSOLE_KEYS if k in clean and math.isfinite(clean[k]))
            width = len(str(self.train_iters))
            print(f"step {step:>{width}}/{self.train_iters} | ETA {self.eta(step)} | {shown}", flush=True)

    def eta(self, step: int) -> str:
        """``h:mm:ss`` left after step ``step`` at this run's mean pace so far."""
        per_step = (time.perf_counter() - self.start_time) / max(step - self.start_step, 1)
        return str(datetime.timedelta(seconds=round(per_step * max(self.train_iters - step, 0))))

    def finish(self) -> None:
        """Close the run (flushes wandb's files)."""
        if self.rank0:
            if self.jsonl is not None:
                self.jsonl.close()
            if self.wandb_run is not None:
                self.wandb_run.finish()
