"""Kernel rates on one H200 (bf16), the planner's time constants, and where each was measured.

Scaled to another GPU by its dense bf16 peak (``hardware.py``). Two sources:
- kernel measurements on the H200 (the attention rates: torch cuDNN SDPA, 8 query / 2 KV heads
  of 256, 32K queries over 262K-1M keys: forward 619-666 TFLOP/s, backward 361-362 TFLOP/s with
  the backward counted as 2.5 x the forward's FLOPs);
- the benchmark's own runs (``python tools/bench_longstraw.py ...``, each command in
  ``docs/bench/``), from which the rest are read off by least squares
  (``python tools/plan_budget.py --fit-rates docs/bench`` recomputes them: ``calibration.py``;
  ``docs/planning.md`` shows how well every run is then predicted).
"""

ATTENTION_FWD_TFLOPS = 650.0
"""Dense causal/prefix attention forward (cuDNN SDPA), TFLOP/s."""
ATTENTION_BWD_TFLOPS = 372.0
"""Its backward, TFLOP/s, FLOPs counted as ``ATTENTION_BWD_FLOPS_RATIO`` x the forward's: read off
the replays (the isolated kernel measures 361-362)."""
SWEEP_ATTENTION_BWD_TFLOPS = 420.0
"""The exact mode's sweep: attention backward, effective TFLOP/s read off the exact runs (a chunk of
4K-32K queries over the earlier keys, in ``--prefix-block`` blocks). It is above the isolated
kernel's 362: the cause is not known (docs/planning.md)."""
ATTENTION_BWD_FLOPS_RATIO = 2.5
"""Backward FLOPs over forward FLOPs of attention (scores recomputed, dQ, dK, dV)."""
LINEAR_TFLOPS = 453.0
"""GEMMs of the decoder and the output layer, TFLOP/s, read off the captures."""
DELTA_RULE_FWD_S = 10.0e-3 / (262144 * 16)
"""Gated DeltaNet chunked delta rule forward per token and value head (fla 0.6.0: 10.0 ms for
262,144 tokens x 16 heads of 128 x 128)."""
DELTA_RULE_BWD_RATIO = 2.5
"""Its backward over its forward (fla's chunked backward recomputes the chunk states, then the
gradients: about attention's 2.5x). Assumed, not fitted: the replays cannot tell it from the
per-micro-batch overhead (nearly all of them replay 8K-token responses)."""
TOKEN_LAYER_S = 0.0
"""Elementwise work per token and layer (norms, activations, residuals, routing): the fit gives 0,
this work is inside the GEMM rate at the measured sizes."""
SPARSE_MLA_TFLOPS = 55.3
"""DSA sparse MLA forward, TFLOP/s."""
SPARSE_MLA_BWD_TFLOPS = 1.82
"""Its backward, TFLOP/s."""
INDEXER_TFLOPS = 111.2
"""DSA indexer scores and top-k selection, TFLOP/s of its score FLOPs."""
CHUNK_OVERHEAD_S = 0.0444
"""Fixed cost per capture chunk (launches, state appends)."""
REPLAY_OVERHEAD_S = 0.194
"""Fixed cost per replayed micro-batch (launches, the autograd graph of every layer, the loss):
what makes a 1K-token response's replay twice its kernels' time."""
SWEEP_CHUNK_OVERHEAD_S = 0.0786
"""Fixed cost per chunk of the exact sweep (its recompute's launches and graph, the gradient
injection into the chunk's state)."""
PARALLEL_EFFICIENCY = 0.9
"""Fraction of the ideal speed-up TP x CP keeps (collectives): CP=2 capture and replay of
qwen3.5-0.8b at 512K and 1M."""
PIPELINE_REPLAY_EFFICIENCY = 0.84
"""Fraction of the ideal speed-up of PP in replay beyond the schedule's warm-up and drain (p2p,
imbalance): the PP=2 run at 512K. Capture pipelines its chunks' slices fully (measured 2.0x)."""
DECODE_BANDWIDTH_FRACTION = 0.6
"""Fraction of the HBM bandwidth a decode step's reads reach: an assumption of a graph-captured
decode step, which is not built; today's decoder is launch-bound, at 1-2% of the bound
(``docs/decode.md``)."""
DECODE_STEP_S = 2e-3
"""Fixed cost per decode step (launches over every layer): the same assumption; measured today
about 85 ms on ``qwen3.5-0.8b`` (``docs/decode.md``), so planned decode times are far too low."""
OPTIMIZER_BANDWIDTH_FRACTION = 0.5
"""Fraction of the HBM bandwidth the optimizer step reaches."""
