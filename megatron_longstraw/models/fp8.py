"""FP8 with Transformer Engine in LongStraw: what the recipe's state does in capture and replay,
and a probe that turns an FP8 recipe this GPU or TE cannot run into a ``ValueError`` naming the
flags.

Megatron enters TE's ``fp8_autocast`` around every transformer layer it runs (``get_fp8_context``
in ``TransformerBlock``), with the recipe built from ``--fp8-format``/``--fp8-recipe``. LongStraw
runs the same blocks in both phases, so FP8 covers the prompt capture (many no-grad chunks) and
the response replay (forward and backward). What the recipe keeps between calls:

- ``delayed`` (``DelayedScaling``): each FP8 tensor's scale comes from a history of its amax over
  earlier forwards (and, for gradients, earlier backwards). The capture's chunks are forwards of
  the same weights over tokens of the same distribution as the responses, so they enter the
  forward histories like any training forward: by the time the first response replays, the
  activation and weight scales are calibrated on the whole prompt instead of starting from the
  default. The gradient histories only ever see backward passes, i.e. replays. Nothing is reset
  between the phases: resetting would make each step's first replay run on uncalibrated scales.
  A model's very first backward has no gradient history at all: TE casts its output gradients
  with the initial scale 1.0, and E5M2 (smallest subnormal 1.5e-5) flushes most of a loss
  gradient normalized over thousands of tokens to zero. So the first replay of a delayed-scaling
  model runs its first micro-batch once more before the real one (``calibrate_gradient_scales``):
  that backward records the gradient amaxes and its gradients are dropped. Once per process; a
  checkpoint resumed in a new process calibrates again, which costs one micro-batch. (Open
  defect: on ``qwen3.5-0.8b`` the FP8 replay gradients are still far from bf16's with this
  calibration, and with ``tensorwise`` too, while the loss agrees; ``docs/transformer_engine.md``.)
- ``tensorwise`` (``Float8CurrentScaling``), ``blockwise`` (``Float8BlockScaling``), ``mxfp8``: the
  scales come from the tensor being cast, so there is no state to carry; capture and replay are
  independent by construction.
- Weights are cast to FP8 at every forward (Megatron passes no ``is_first_microbatch``), so an
  optimizer step between groups is always seen.
- The prompt state itself (K/V pages, MLA latents, indexer keys, Gated DeltaNet states) stays in
  the model's dtype: FP8 applies to the GEMMs, not to what is kept.
"""

import torch


def probe_fp8_recipe(config) -> None:
    """``ValueError`` naming ``--fp8-format``/``--fp8-recipe`` when TE cannot run that recipe on
    this GPU (e.g. ``mxfp8`` before Blackwell, ``blockwise`` on a TE that lacks it): one small
    ``te.Linear`` forward inside Megatron's own FP8 context for ``config``."""
    import transformer_engine.pytorch as te
    from megatron.core.fp8_utils import get_fp8_context

    flags = f"--fp8-format {config.fp8} --fp8-recipe {getattr(config.fp8_recipe, 'value', config.fp8_recipe)}"
    try:
        layer = te.Linear(128, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
        with get_fp8_context(config):
            layer(torch.randn(128, 128, dtype=torch.bfloat16, device="cuda"))
        torch.cuda.synchronize()
    except Exception as err:  # TE reports an unsupported recipe with assertions or runtime errors
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{flags} is not supported on this GPU / Transformer Engine: {reason}") from err


_CALIBRATED = "_longstraw_fp8_gradients_calibrated"


def _recipe(config) -> str:
    return getattr(config.fp8_recipe, "value", config.fp8_recipe)


def gradient_scales_uncalibrated(model) -> bool:
    """True while ``model`` runs FP8 with delayed scaling and has had no calibration backward:
    its gradient scales are then TE's initial 1.0 (see the module docstring)."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "fp8", None) or getattr(model, _CALIBRATED, False):
        return False
    return _recipe(config) == "delayed"


def calibrate_gradient_scales(model, backward_once) -> None:
    """Run ``backward_once()`` (one micro-batch's forward and backward) so that the gradient amax
    histories hold real values, then drop the gradients it left (``.grad`` and Megatron's
    ``main_grad``). Runs before any gradient of the step has accumulated."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        for grad in (p.grad, getattr(p, "main_grad", None)):
            assert grad is None or not grad.any(), "FP8 calibration must run before gradients accumulate"
    setattr(model, _CALIBRATED, True)
    backward_once()
    for p in params:
        p.grad = None
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.zero_()
