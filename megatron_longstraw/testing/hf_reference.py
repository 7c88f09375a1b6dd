"""Tiny Hugging Face reference models, built locally with random weights.

On a machine without a GPU, transformers would pick fla's Triton kernels for Gated DeltaNet
whenever fla imports (it does, also on CPU) and then fail; ``hf_model_class`` imports the
modeling module with fla hidden so that transformers binds its own torch fallback.
"""

import importlib
import sys

import torch
from torch.overrides import TorchFunctionMode

from megatron_longstraw.models.registry import family_for
from megatron_longstraw.patches.dsa_causal_topk import causal_topk

def _import_without_fla(module_name: str):
    if module_name in sys.modules:
        return sys.modules[module_name]
    hidden = {name: sys.modules[name] for name in list(sys.modules)
              if name == "fla" or name.startswith("fla.")}
    for name in hidden:
        del sys.modules[name]
    sys.modules["fla"] = None  # makes `import fla` raise ImportError
    try:
        return importlib.import_module(module_name)
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)


def hf_model_class(model_type: str):
    """``(ModelClass, ConfigClass)`` of the family's HF reference (``hf_reference``) for a model
    type; torch kernels forced when there is no GPU. ``ValueError`` when the family has none."""
    family = family_for(model_type)
    classes = family.hf_reference(model_type)
    if classes is None:
        raise ValueError(f"model_type {model_type!r}: the family {family.name} has no HF reference model")
    modeling, model_cls, configuration, config_cls = classes
    if torch.cuda.is_available():
        module = importlib.import_module(modeling)
    else:
        module = _import_without_fla(modeling)
    return getattr(module, model_cls), getattr(importlib.import_module(configuration), config_cls)


def build_hf_model(hf: dict, seed: int = 0, dtype=torch.float32, init_scale: float = 0.02):
    """A random-weight HF causal LM for ``hf`` (an HF-style config dict), in eval mode.

    Every parameter is drawn from ``N(0, init_scale)`` (norm weights around their neutral value
    plus noise) so that no weight is trivially zero or one and every mapping error shows; so is
    the persistent MoE routing-bias buffer ``e_score_correction_bias`` (``N(0, 0.01)``: it still
    changes expert choices, but smaller than the token-dependent spread of the sigmoid router
    scores at this init; at ``N(0, 0.1)`` it dominated them, routing ignored the token and most
    experts of the debug models never received a token).
    """
    model_cls, config_cls = hf_model_class(hf["model_type"])
    fields = {k: v for k, v in hf.items() if not k.startswith("_") and k != "model_type"}
    config = config_cls(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                param.add_(torch.randn_like(param) * 0.1)
            elif param.dim() >= 2 or "bias" in name:
                param.normal_(0.0, init_scale if param.dim() >= 2 else 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # MoE routing bias (GLM-5, DeepSeek)
                buffer.normal_(0.0, 0.01)
    _use_causal_indexer_topk(model)
    return model.eval()


class _CausalTopk(TorchFunctionMode):
    """``Tensor.topk`` over the last dim with exact ties broken by position (lower first)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.topk, torch.topk):
            bound = dict(zip(("input", "k", "dim", "largest", "sorted"), args), **kwargs)
            scores, k = bound["input"], bound["k"]
            if bound.get("dim", -1) in (-1, scores.dim() - 1) and bound.get("largest", True):
                return torch.return_types.topk(causal_topk(scores, k))
        return func(*args, **kwargs)


def _use_causal_indexer_topk(model) -> None:
    """Give HF's DSA indexers the project's causal tie rule (``patches.dsa_causal_topk``).

    HF's ``index_scores.topk`` returns, among exactly tied scores, keys that depend on the row
    length (how many masked tokens follow the query), so HF's selection is not causal; the
    Megatron model ranks ties by position, and the reference must agree on tied rows.
    """
    for module in model.modules():
        if type(module).__name__.endswith("DsaIndexer"):
            mode = _CausalTopk()
            module.register_forward_pre_hook(lambda *_, mode=mode: mode.__enter__() and None)
            module.register_forward_hook(lambda *_, mode=mode: mode.__exit__(None, None, None) and None,
                                         always_call=True)
