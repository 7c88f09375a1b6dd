"""CPU patch: Megatron's optimizer and DDP gradient buffers run without CUDA.

``megatron.core.optimizer.optimizer`` and ``optimizer.clip_grads`` allocate small tensors with a
literal ``device='cuda'`` (loss scale, found-inf flag, the grad-norm all-reduce buffer, the
torch fallback of the multi-tensor L2 norm in ``megatron.core.utils``), and
``distributed.param_and_grad_buffer`` asks for ``torch.cuda.current_stream()`` before every
gradient reduction (to wait on CUDA-graph events, which a CPU run never has). This patch gives
those four modules a ``torch`` whose tensor factories map ``device='cuda'`` to the CPU and whose
``torch.cuda.current_stream()`` is a stream that has nothing to wait for; everything else is the
real ``torch``. Gradient clipping asserts ``grad.type() == 'torch.cuda.FloatTensor'``; the
optimizer gets a host twin of ``clip_grad_by_total_norm_fp32`` (same scaling, fp32 grads checked).
"""

import types

import torch
from megatron.core import utils as utils_module
from megatron.core.distributed import param_and_grad_buffer as grad_buffer_module
from megatron.core.optimizer import clip_grads as clip_grads_module
from megatron.core.optimizer import optimizer as optimizer_module

_MODULES = (optimizer_module, clip_grads_module, grad_buffer_module, utils_module)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


def _cpu_device(kwargs: dict) -> dict:
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        kwargs = {**kwargs, "device": "cpu"}
    return kwargs


class _HostStream:
    """What ``torch.cuda.current_stream()`` returns on the CPU: nothing is pending on it."""

    def wait_event(self, event) -> None:
        raise AssertionError("a CPU run has no CUDA events to wait for")

    def wait_stream(self, stream) -> None:
        return None


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` for the patched modules, with a host ``current_stream``."""

    def __init__(self):
        super().__init__("torch.cuda")

    def current_stream(self, device=None) -> _HostStream:
        return _HostStream()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuFactoryTorch(types.ModuleType):
    """``torch`` for the patched modules: factories with ``device='cuda'`` allocate on the CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            factory = getattr(torch, name)
            setattr(self, name, lambda *args, _f=factory, **kwargs: _f(*args, **_cpu_device(kwargs)))

    def __getattr__(self, name):
        return getattr(torch, name)


_ORIGINAL_CLIP = optimizer_module.clip_grad_by_total_norm_fp32


def _host_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Scale the fp32 gradients in place by ``min(1, max_norm / (total_norm + 1e-6))``."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    assert all(g.dtype == torch.float32 or use_decoupled_grad for g in grads)
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(clip_coeff, torch.Tensor):
        clip_coeff = clip_coeff.clamp_max(1.0)
    elif clip_coeff >= 1.0:
        return
    for grad in grads:
        grad.detach().mul_(clip_coeff)


def use_cpu_torch(modules, cpu: bool = True) -> None:
    """Give ``modules`` the CPU ``torch`` (``cpu=False``: the real one back)."""
    proxy = _CpuFactoryTorch() if cpu else torch
    for module in modules:
        module.torch = proxy


def needed() -> bool:
    """True when this process has no usable GPU."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Give Megatron's optimizer and grad-buffer modules the CPU ``torch``."""
    use_cpu_torch(_MODULES)
    optimizer_module.clip_grad_by_total_norm_fp32 = _host_clip_grad_by_total_norm_fp32


def revert() -> None:
    """Give them the real ``torch`` back."""
    use_cpu_torch(_MODULES, cpu=False)
    optimizer_module.clip_grad_by_total_norm_fp32 = _ORIGINAL_CLIP
