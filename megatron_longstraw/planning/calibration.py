"""Read the planner's fitted kernel rates off the benchmark's measured runs (``kernels.py`` states
the result; ``python tools/plan_budget.py --fit-rates docs/bench`` recomputes it).

Three least-squares fits, each on the single-GPU points (no CP, no PP; not the runs made before
the benchmark warmed up, ``measured.COLD_RUNS``: their warm-up-less points did not warm the
shapes of later points either, but only their first point compiled) and each with the
rates measured on kernels alone held fixed (attention forward, Gated DeltaNet forward), the
errors weighted by the measured time (relative):
- capture (warm points only: ``MeasuredPoint.cold``): GEMM rate, per token-layer work and
  per-chunk overhead; the DSA indexer and sparse MLA rates come from the capture split of the
  longest GLM run;
- replay (per response): attention backward, Gated DeltaNet backward, sparse MLA backward;
- exact sweep: its attention backward.
"""

from pathlib import Path

import numpy as np

from megatron_longstraw.planning import kernels as K
from megatron_longstraw.planning.measured import COLD_RUNS, measured_points
from megatron_longstraw.planning.timing import prompt_work, span_work


def _lstsq(columns: list[list[float]], known: list[float], measured: list[float]) -> np.ndarray:
    """Coefficients of ``measured - known ~ columns @ x``, relative errors."""
    a = np.array(columns, dtype=float) / np.array(measured)[:, None]
    b = (np.array(measured) - np.array(known)) / np.array(measured)
    return np.linalg.lstsq(a, b, rcond=None)[0]


def fit_rates(folder: str | Path) -> dict:
    """The fitted constants of ``kernels.py`` (same names), from ``folder``'s runs."""
    every = measured_points(folder)[0]
    points = [p for p in every if not p.oom and p.plan.layout.cp == 1 and p.plan.layout.pp == 1
              and not (p.index == 0 and p.file in COLD_RUNS)]
    fitted = {}
    split = max((p for p in every if (p.result.get("capture_split_s") or {}).get("indexer")),
                key=lambda p: p.result["prompt_length"])  # the longest: compilation weighs least
    work = prompt_work(split.profile, split.plan.run)
    fitted["INDEXER_TFLOPS"] = work.indexer / split.result["capture_split_s"]["indexer"] / 1e12
    fitted["SPARSE_MLA_TFLOPS"] = work.sparse / split.result["capture_split_s"]["sparse_attention"] / 1e12
    rates = {**vars(K), **fitted}
    # capture
    cols, known, meas = [], [], []
    for p in points:
        if p.cold:  # its capture compiled kernels (``MeasuredPoint.cold``)
            continue
        w = prompt_work(p.profile, p.plan.run)
        cols.append([w.linear / 1e12, w.tokens, p.plan.run.num_chunks])
        known.append(w.attention / 1e12 / K.ATTENTION_FWD_TFLOPS + w.delta_rule * K.DELTA_RULE_FWD_S
                     + w.indexer / 1e12 / rates["INDEXER_TFLOPS"] + w.sparse / 1e12 / rates["SPARSE_MLA_TFLOPS"])
        meas.append(p.result["capture_s"])
    inv_linear, token, chunk = _lstsq(cols, known, meas)
    fitted.update(LINEAR_TFLOPS=1 / inv_linear, TOKEN_LAYER_S=token, CHUNK_OVERHEAD_S=chunk)
    # replay, per response
    cols, known, meas = [], [], []
    for p in points:
        r = p.result
        w = span_work(p.profile, r["prompt_length"], r["response_length"], logits=True)
        cols.append([K.ATTENTION_BWD_FLOPS_RATIO * w.attention / 1e12, w.delta_rule,
                     K.ATTENTION_BWD_FLOPS_RATIO * w.sparse / 1e12])
        known.append(3 * w.linear / 1e12 / fitted["LINEAR_TFLOPS"] + 3 * w.tokens * token
                     + w.attention / 1e12 / K.ATTENTION_FWD_TFLOPS + w.delta_rule * K.DELTA_RULE_FWD_S
                     + w.indexer / 1e12 / rates["INDEXER_TFLOPS"] + w.sparse / 1e12 / rates["SPARSE_MLA_TFLOPS"])
        meas.append(sum(r["replay_s"]) / len(r["replay_s"]))
    inv_bwd, delta_bwd, inv_sparse_bwd = _lstsq(cols, known, meas)
    fitted.update(ATTENTION_BWD_TFLOPS=1 / inv_bwd, DELTA_RULE_BWD_S=delta_bwd, SPARSE_MLA_BWD_TFLOPS=1 / inv_sparse_bwd)
    # the exact sweep
    cols, known, meas = [], [], []
    for p in points:
        if p.result.get("prompt_backward_s") is None:
            continue
        w = prompt_work(p.profile, p.plan.run, indexer=False)
        cols.append([K.ATTENTION_BWD_FLOPS_RATIO * w.attention / 1e12])
        known.append(3 * w.linear / 1e12 / fitted["LINEAR_TFLOPS"] + 3 * w.tokens * token
                     + w.attention / 1e12 / K.ATTENTION_FWD_TFLOPS + w.delta_rule * (K.DELTA_RULE_FWD_S + delta_bwd)
                     + p.plan.run.num_chunks * chunk)
        meas.append(p.result["prompt_backward_s"])
    if meas:
        fitted["SWEEP_ATTENTION_BWD_TFLOPS"] = 1 / _lstsq(cols, known, meas)[0]
    return fitted
