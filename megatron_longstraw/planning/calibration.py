"""Read the planner's fitted kernel rates off the benchmark's measured runs (``kernels.py`` states
the result; ``python tools/plan_budget.py --fit-rates docs/bench`` recomputes it).

Three non-negative least-squares fits, each on the single-GPU points (no CP, no PP; not the runs
made before the benchmark warmed up, ``measured.COLD_RUNS``: their warm-up-less points did not
warm the shapes of later points either, but only their first point compiled; not the points
``measured.COLD_POINTS`` names, nor the runs of ``measured.UNMODELED_TIMES``) and each with the
rates measured on kernels alone held fixed (attention forward, Gated DeltaNet forward) and Gated DeltaNet's backward as
``kernels.DELTA_RULE_BWD_RATIO`` times its forward, the errors weighted by the measured time
(relative):
- capture (warm points only: ``MeasuredPoint.cold``): GEMM rate, per token-layer work and
  per-chunk overhead; the DSA indexer and sparse MLA rates come from the capture split of the
  longest GLM run;
- replay (per response): attention backward, sparse MLA backward, per-micro-batch overhead;
- exact sweep: its attention backward and per-chunk overhead.
"""

import itertools
from pathlib import Path

import numpy as np

from megatron_longstraw.planning import kernels as K
from megatron_longstraw.planning.measured import COLD_POINTS, COLD_RUNS, measured_points
from megatron_longstraw.planning.timing import prompt_work, span_work


def nonnegative_lstsq(columns: list[list[float]], known: list[float], measured: list[float]) -> np.ndarray:
    """Coefficients ``x >= 0`` of ``measured - known ~ columns @ x``, relative errors: the best
    unconstrained fit over every subset of the columns whose coefficients are all non-negative
    (exact for the few columns here). A physical constant cannot be negative; a term the data
    cannot resolve comes out 0."""
    a = np.array(columns, dtype=float) / np.array(measured)[:, None]
    b = (np.array(measured) - np.array(known)) / np.array(measured)
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(b ** 2))
    for size in range(1, a.shape[1] + 1):
        for subset in itertools.combinations(range(a.shape[1]), size):
            x = np.linalg.lstsq(a[:, subset], b, rcond=None)[0]
            if (x < 0).any():
                continue
            full = np.zeros(a.shape[1])
            full[list(subset)] = x
            residual = float(np.sum((a @ full - b) ** 2))
            if residual < best_residual:
                best, best_residual = full, residual
    return best


def _inverse(x: float) -> float:
    return 1 / x if x > 0 else float("inf")


def fit_rates(folder: str | Path) -> dict:
    """The fitted constants of ``kernels.py`` (same names), from ``folder``'s runs."""
    every = measured_points(folder)[0]
    points = [p for p in every if not p.oom and p.plan.layout.cp == 1 and p.plan.layout.pp == 1 and p.times_modeled
              and not (p.index == 0 and p.file in COLD_RUNS) and (p.file, p.index) not in COLD_POINTS]
    fitted = {}
    split = max((p for p in every if (p.result.get("capture_split_s") or {}).get("indexer")),
                key=lambda p: p.result["prompt_length"])  # the longest: compilation weighs least
    work = prompt_work(split.profile, split.plan.run)
    fitted["INDEXER_TFLOPS"] = work.indexer / split.result["capture_split_s"]["indexer"] / 1e12
    fitted["SPARSE_MLA_TFLOPS"] = work.sparse / split.result["capture_split_s"]["sparse_attention"] / 1e12
    delta_fwd, delta_bwd = K.DELTA_RULE_FWD_S, K.DELTA_RULE_BWD_RATIO * K.DELTA_RULE_FWD_S

    def forward_known(w):  # the forward's terms at the rates already known
        return (w.attention / 1e12 / K.ATTENTION_FWD_TFLOPS + w.delta_rule * delta_fwd
                + w.indexer / 1e12 / fitted["INDEXER_TFLOPS"] + w.sparse / 1e12 / fitted["SPARSE_MLA_TFLOPS"])

    # capture
    cols, known, meas = [], [], []
    for p in points:
        if p.cold:  # its capture compiled kernels (``MeasuredPoint.cold``)
            continue
        w = prompt_work(p.profile, p.plan.run)
        cols.append([w.linear / 1e12, w.tokens, p.plan.run.num_chunks])
        known.append(forward_known(w))
        meas.append(p.result["capture_s"])
    inv_linear, token, chunk = nonnegative_lstsq(cols, known, meas)
    fitted.update(LINEAR_TFLOPS=_inverse(inv_linear), TOKEN_LAYER_S=token, CHUNK_OVERHEAD_S=chunk)

    def tokens_known(w):  # forward and backward of the per-token terms at the fitted rates
        return 3 * w.linear / 1e12 * inv_linear + 3 * w.tokens * token + w.delta_rule * (delta_fwd + delta_bwd)

    # replay, per response
    cols, known, meas = [], [], []
    for p in points:
        r = p.result
        w = span_work(p.profile, r["prompt_length"], r["response_length"], logits=True)
        per_response = 1.0 / int(p.flags["--replay-micro-batch-size"])  # the overhead is per micro-batch
        cols.append([K.ATTENTION_BWD_FLOPS_RATIO * w.attention / 1e12, K.ATTENTION_BWD_FLOPS_RATIO * w.sparse / 1e12,
                     per_response])
        known.append(forward_known(w) - w.delta_rule * delta_fwd + tokens_known(w))
        meas.append(sum(r["replay_s"]) / len(r["replay_s"]))
    inv_bwd, inv_sparse_bwd, overhead = nonnegative_lstsq(cols, known, meas)
    fitted.update(ATTENTION_BWD_TFLOPS=_inverse(inv_bwd), SPARSE_MLA_BWD_TFLOPS=_inverse(inv_sparse_bwd),
                  REPLAY_OVERHEAD_S=overhead)
    # the exact sweep: every chunk's forward and backward, the indexer's top-k forward only
    cols, known, meas = [], [], []
    for p in points:
        if p.result.get("prompt_backward_s") is None:
            continue
        w = prompt_work(p.profile, p.plan.run)
        cols.append([K.ATTENTION_BWD_FLOPS_RATIO * w.attention / 1e12, p.plan.run.num_chunks])
        known.append(forward_known(w) - w.delta_rule * delta_fwd + tokens_known(w)
                     + K.ATTENTION_BWD_FLOPS_RATIO * w.sparse / 1e12 * inv_sparse_bwd)
        meas.append(p.result["prompt_backward_s"])
    if meas:
        inv_sweep, sweep_chunk = nonnegative_lstsq(cols, known, meas)
        fitted.update(SWEEP_ATTENTION_BWD_TFLOPS=_inverse(inv_sweep), SWEEP_CHUNK_OVERHEAD_S=sweep_chunk)
    return fitted
