"""FP8 with Transformer Engine in LongStraw: what the recipe's state does in capture and replay,
and a probe that turns an FP8 recipe this GPU or TE cannot run into a ``ValueError`` naming the
flags.

Megatron's ``TransformerBlock`` enters TE's ``fp8_autocast`` (``get_fp8_context``, the recipe
built from ``--fp8-format``/``--fp8-recipe``) around the whole block under delayed scaling and
around each layer otherwise. LongStraw runs the same blocks in both phases, so FP8 covers the
prompt capture (many no-grad chunks) and the response replay (forward and backward). What the
recipe keeps between calls:

- ``delayed`` (``DelayedScaling``): each FP8 tensor's scale comes from a history of its amax over
  earlier forwards (and, for gradients, earlier backwards). TE moves the forward scales only
  when an ``fp8_autocast`` region exits with gradients enabled: the capture's no-grad chunks
  record amaxes but keep the scales that the last replay forward left (the previous step's, in
  training), and each replay forward moves them on. Nothing is reset between the phases.
  A model's very first backward has no gradient history at all: TE casts its output gradients
  with the initial scale 1.0, and E5M2 (smallest subnormal 1.5e-5) flushes most of a loss
  gradient normalized over thousands of tokens to zero. So the first replay of a delayed-scaling
  model runs its first micro-batch once more before the real one (``calibrate_gradient_scales``):
  that backward records the gradient amaxes and its gradients are dropped. Once per process; a
  checkpoint resumed in a new process calibrates again, which costs one micro-batch.
  (On random weights FP8 moves ``qwen3.5-0.8b``'s replay gradients to cosine ~0.42 from bf16's
  whatever the implementation: an exact emulation of FP8 numerics gives that too,
  ``tools/fp8_sensitivity.py``. TE's delayed scaling gave 0.067 before ``prepare_forward``,
  below: ``docs/transformer_engine.md``.)
- ``tensorwise`` (``Float8CurrentScaling``), ``blockwise`` (``Float8BlockScaling``), ``mxfp8``: the
  scales come from the tensor being cast, so there is no state to carry; capture and replay are
  independent by construction.
- The weights' FP8 copies: Megatron's TE layers pass ``is_first_microbatch=True`` to TE on
  their first call and ``False`` ever after, so TE casts each weight to FP8 once and reuses that
  copy, until ``set_is_first_microbatch()`` raises the flag again (Megatron's pipeline schedule
  does so at each step's first micro-batch; LongStraw's capture does not run through it).
  Without that, every forward after an optimizer step would run on the step-0 weights. So each
  prompt capture and each full-graph pass begins with ``prepare_forward``: the weights are cast
  again, once, for the capture, the rollouts and the replay of that group (the weights do not
  change in between).
- Delayed scaling's first forward has no amax history either: TE casts with scale 1.0, which
  puts weights of scale 0.02 into E4M3's subnormal range (steps of 0.002, smaller values flushed
  to zero), and since the capture runs without gradients the scales would stay at 1.0 for the
  whole capture, and the weight copy cast then for the whole first step. So a delayed-scaling
  model's first capture (or full-graph pass) runs its first chunk beforehand, result dropped,
  then has TE update the forward scales from the amaxes it recorded
  (``update_delayed_forward_scales``, what an autocast exit with gradients does; every rank of
  the amax-reduction group calibrates at its first capture), and does so twice: the second
  pass runs on weights cast with real scales, so its activation amaxes are real too. The
  weights are then cast with them. Once per process, two chunks (in a full-graph pass: the
  prompt and one response). The capture's later chunks cannot move these scales; a value
  beyond them saturates at the format's maximum, as with any delayed scaling.
- The prompt state itself (K/V pages, MLA latents, indexer keys, Gated DeltaNet states) stays in
  the model's dtype: FP8 applies to the GEMMs, not to what is kept.
"""

from typing import Callable

import torch

from megatron_longstraw.models.pipeline_stage import model_chunks


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
_FORWARD_CALIBRATED = "_longstraw_fp8_forward_calibrated"


def _recipe(config) -> str:
    return getattr(config.fp8_recipe, "value", config.fp8_recipe)


def _delayed_scaling_without(model, flag: str) -> bool:
    """True when ``model`` runs FP8 with delayed scaling and has not set ``flag``."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "fp8", None) or getattr(model, flag, False):
        return False
    return _recipe(config) == "delayed"


def gradient_scales_uncalibrated(model) -> bool:
    """True while ``model`` runs FP8 with delayed scaling and has had no calibration backward:
    its gradient scales are then TE's initial 1.0 (see the module docstring)."""
    return _delayed_scaling_without(model, _CALIBRATED)


def calibrate_gradient_scales(model, backward_once) -> None:
    """Run ``backward_once()`` (one micro-batch's forward and backward) so that the gradient amax
    histories hold real values, then drop the gradients it left (``.grad`` and Megatron's
    ``main_grad``). Runs before any gradient of the step has accumulated. If ``backward_once``
    fails (out of memory, say), the model stays uncalibrated and its gradients are dropped too."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        for grad in (p.grad, getattr(p, "main_grad", None)):
            assert grad is None or not grad.any(), "FP8 calibration must run before gradients accumulate"
    setattr(model, _CALIBRATED, True)
    try:
        backward_once()
    except BaseException:
        delattr(model, _CALIBRATED)
        raise
    finally:
        for p in params:
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()


def forward_scales_uncalibrated(model) -> bool:
    """True while ``model`` runs FP8 with delayed scaling and has run no forward yet: its weight
    and activation scales are then TE's initial 1.0 (see the module docstring)."""
    return _delayed_scaling_without(model, _FORWARD_CALIBRATED)


def prepare_forward(model, forward_once: Callable[[], object]) -> None:
    """Before a prompt capture or a full-graph pass: if the forward scales are uncalibrated, run
    ``forward_once()`` (a forward whose result the caller drops) so that they are not; then make
    every TE layer of every model chunk cast its weight to FP8 again at its next call (Megatron's
    ``set_is_first_microbatch``, a no-op without FP8)."""
    if forward_scales_uncalibrated(model):
        setattr(model, _FORWARD_CALIBRATED, True)  # before: ``forward_once`` may be a capture itself
        try:
            # twice: the first pass runs on weights cast with scale 1.0, so the activations it
            # records past the first layer are off; the second runs on properly cast weights
            for _ in range(2):
                _recast_weights(model)
                forward_once()
                update_delayed_forward_scales()
        except BaseException:
            delattr(model, _FORWARD_CALIBRATED)
            raise
    _recast_weights(model)


def _recast_weights(model) -> None:
    for chunk in model_chunks(model):
        chunk.set_is_first_microbatch()


def update_delayed_forward_scales() -> None:
    """Have TE reduce the recorded forward amaxes over their groups and set the delayed-scaling
    forward scales from them: what leaving an ``fp8_autocast`` region with gradients enabled does
    (TE skips it without gradients, as in the capture). Collective over each amax-reduction group."""
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)
