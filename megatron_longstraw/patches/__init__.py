"""Every runtime patch this project makes to Megatron-Core (or torch), one small module each.

Each patch module exposes ``needed() -> bool``, ``apply()`` and ``revert()``. ``apply_patches()``
applies, in order, those whose ``needed()`` is true; it is idempotent. Nothing outside this
package monkeypatches Megatron. Current patches:

- ``gdn_out_norm_tp_grads`` (everywhere): sum GDN ``out_norm`` gradients over TP ranks.
- ``dsa_causal_topk`` (everywhere): DSA's naive top-k breaks exact score ties by position, so a
  token's selection does not depend on how many tokens follow it (exact prompt state).
- ``dsa_promote_precision`` (everywhere): DSA's unfused math in ``promote(dtype, fp32)`` instead
  of fp32 (fp64 models stay fp64; no change below fp64).
- ``attention_gate_precision`` (everywhere): the attention output gate keeps fp64 for fp64
  models (Megatron's gates in fp32; no change below fp64).
- ``moe_router_precision`` (everywhere): the MoE router's sigmoid / sqrt-softplus probabilities
  keep fp64 for fp64 logits (Megatron's in fp32; same selection; no change below fp64).
- ``cross_entropy_precision`` (everywhere): Megatron's vocab-parallel cross entropy keeps fp64
  for fp64 logits (Megatron's in fp32; no change below fp64).
- ``save_results_in_process`` (everywhere): Megatron's synchronous checkpoint save keeps its
  write results in this process instead of a spawned manager's queue, so it starts no process
  (none lives on after a killed trainer).
- ``no_compile`` (CPU, or a GPU process with ``LONGSTRAW_NO_COMPILE=1``: the GPU test tier):
  Megatron's ``torch.compile``'d helpers run eagerly.

CPU-only (a GPU host applies none of these):

- ``cpu_current_device``: ``torch.cuda.current_device()`` -> cpu (Megatron allocates with it).
- ``cpu_rng_tracker``: Megatron's CUDA RNG-states tracker on the CPU generator.
- ``cpu_gated_delta_kernels``: GDN's fla Triton kernels -> pure-torch kernels.
- ``cpu_moe_alltoall``: the all-to-all MoE token dispatcher without CUDA streams (EP > 1).
- ``cpu_cuda_synchronize``: ``torch.cuda.synchronize()`` a no-op (Megatron's checkpoint writer).
- ``cpu_tensor_cuda``: ``Tensor.cuda()`` the identity (tied embeddings across pipeline stages).
- ``cpu_optimizer_device``: Megatron's optimizer allocates its scalars (loss scale, found-inf,
  grad-norm buffer) on the CPU instead of a literal ``device='cuda'``; DDP's gradient reduction
  gets a host stand-in for ``torch.cuda.current_stream()``.
- ``cpu_pipeline_schedules``: Megatron's pipeline schedules and p2p communication allocate on
  the CPU instead of a literal ``device='cuda'`` (they then run over gloo).
"""

import importlib

PATCHES = (
    "gdn_out_norm_tp_grads",
    "dsa_causal_topk",
    "dsa_promote_precision",
    "attention_gate_precision",
    "moe_router_precision",
    "cross_entropy_precision",
    "save_results_in_process",
    "cpu_current_device",
    "cpu_rng_tracker",
    "cpu_gated_delta_kernels",
    "no_compile",
    "cpu_moe_alltoall",
    "cpu_cuda_synchronize",
    "cpu_tensor_cuda",
    "cpu_optimizer_device",
    "cpu_pipeline_schedules",
)

_applied: list[str] = []


def _module(name):
    return importlib.import_module(f"{__name__}.{name}")


def apply_patches() -> list[str]:
    """Apply every needed patch once; returns the names of the patches in force."""
    for name in PATCHES:
        if name not in _applied and _module(name).needed():
            _module(name).apply()
            _applied.append(name)
    return list(_applied)


def revert_patches() -> None:
    """Undo every applied patch (tests use this to check that a patch is what makes code run)."""
    while _applied:
        _module(_applied.pop()).revert()
