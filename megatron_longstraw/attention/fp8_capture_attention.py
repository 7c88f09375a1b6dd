"""FP8 attention in the no-grad prompt capture (``--fp8-attention capture``): cuDNN's ``sdpa_fp8``
on Hopper, through the cuDNN frontend (the optional ``nvidia-cudnn-frontend`` package).

At a long prompt the capture is nearly all attention FLOPs, and on an H200 cuDNN's E4M3 SDPA
forward runs about 1.6x bf16's. A capture chunk's attention is two calls merged by log-sum-exp,
as the bf16 path's (``prefix_attention_cuda``): the chunk's queries over the cached pages (no
mask; in blocks of ``KernelOptions.prefix_block`` keys, so that the whole blocks of every chunk
share one cuDNN graph) and over the chunk itself (causal). Each call returns its softmax stats
(the natural-log log-sum-exp of its scaled scores), which make the merge exact; the merge is fp32.

Scales (current scaling: chosen per call from the tensors themselves, so per chunk and layer).
Every scale is a power of two, so multiplying a bf16 tensor by it is exact and the cast to E4M3
is the only rounding:

- ``Q``, ``K``, ``V``: ``2^floor(log2(448 / amax))`` of the call's tensor (448 is E4M3's largest
  finite value), so the largest element lands in E4M3's top binade and nothing saturates; the
  kernel multiplies its products back by the descales (the reciprocals).
- ``P``, the unnormalized probabilities ``exp(S - rowmax)``: in ``(0, 1]``, so the fixed
  scale 256 (the power of two below 448) needs no pass over them.
- ``O``: a convex combination of ``V``'s rows, so ``|O| <= amax(V)``, but the rounded
  probabilities over their unrounded row sum can exceed 1 by E4M3's rounding (up to 2^-4): half of
  ``V``'s scale leaves that room. Hopper's kernel writes ``O`` in E4M3, dequantized here (fp32)
  before the merge.

Values are centred. Each call subtracts from its block of ``V`` the block's mean value per KV
head (``mu``, rounded to ``V``'s dtype), casts ``V - mu`` to E4M3 and adds ``mu`` back to the
dequantized output. In exact arithmetic that changes nothing, since every row's weights sum to
one: ``sum_j p_j (v_j - mu) + mu = sum_j p_j v_j``. On Hopper it is what makes the kernel
accurate: its ``P V`` accumulation loses precision in proportion to the accumulated output, so
values sharing a direction (a model's do: the output sits near their mean) come out shrunk by
an error that grows with the key count, while zero-mean values come out as accurate as FP8
rounding allows (``docs/transformer_engine.md`` has the measurements). Centred, the accumulated
sum is zero-mean whatever the values; the mean itself is added in fp32, and the rounding of the
probabilities no longer scales it either (the uncentred output carries ``mu`` times the rounded
row sum over the exact one).

The K/V pages stay bf16 in the prompt state; each call casts its block of them to E4M3 (a
transient of one byte per element of the block). Replay, decoding and the prompt backward keep
their bf16 attention. ``testing/fp8_attention_emulation.py`` emulates these numerics on any
machine (its ``emulated_sdpa_fp8`` is the kernel's reference); without context parallelism only.

One cuDNN per process: where Transformer Engine has loaded a second cuDNN beside torch's (a
system one), the kernel's output is wrong, so that is refused (``check_one_cudnn``).
"""

import importlib
import os
from collections import OrderedDict
from typing import Callable, Optional

import torch

from megatron_longstraw.attention.partials import default_scale, expand_groups, merge_partials
from megatron_longstraw.config.kernels import KernelOptions

FLAG = "--fp8-attention capture"
E4M3_MAX = 448.0
P_SCALE = 256.0
"""Scale of the unnormalized probabilities (at most 1): the largest power of two below E4M3_MAX."""


def pow2_scale(amax_X: torch.Tensor, fp8_max: float = E4M3_MAX) -> torch.Tensor:
    """``2^floor(log2(fp8_max / amax))`` (fp32, same shape): the largest power-of-two scale that
    keeps ``amax`` within ``fp8_max`` (within fp32's normal exponents); 1 where ``amax`` is 0 or not
    finite."""
    amax_X = amax_X.float()
    ok_X = torch.isfinite(amax_X) & (amax_X > 0)
    exponent_X = torch.floor(torch.log2(fp8_max / torch.where(ok_X, amax_X, 1.0))).clamp(-126, 126)  # fp32's
    return torch.where(ok_X, torch.exp2(exponent_X), 1.0)


def cast_fp8(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x * scale in fp8_dtype, 1 / scale)`` with ``scale = pow2_scale(amax(x))`` as a
    one-element fp32 tensor (``[1, 1, 1, 1]``, the kernel's scalar layout). The cast is written
    contiguous whatever ``x``'s strides (a permuted ``[b, heads, s, d]`` view of the pages comes
    out ``[b, heads, s, d]`` in memory): the layout cuDNN's FP8 kernel is verified on."""
    scale = pow2_scale(x.detach().abs().amax())
    return (x * scale.to(x.dtype)).to(fp8_dtype, memory_format=torch.contiguous_format), (1.0 / scale).reshape(1, 1, 1, 1)


def cudnn_library_folders(maps_text: str) -> list[str]:
    """The folders of the cuDNN libraries (``libcudnn*.so*``) a process has mapped, from the text
    of its ``/proc/self/maps`` (sorted)."""
    folders = set()
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        name = os.path.basename(fields[5]) if len(fields) == 6 else ""
        if name.startswith("libcudnn") and ".so" in name:
            folders.add(os.path.dirname(fields[5]))
    return sorted(folders)


def check_one_cudnn(maps_path: str = "/proc/self/maps") -> None:
    """``ValueError`` naming the flag where this process has cuDNN libraries from more than one
    folder. Importing Transformer Engine (Megatron does whenever it is installed) loads the cuDNN
    it finds first, ``CUDNN_HOME`` or else the loader's: on a host with a system cuDNN beside the
    one bundled with torch, two versions then share the process, and cuDNN's FP8 attention comes
    out wrong (a chunk over a million pages 7.8-9.2% off exact attention, varying run to run, where
    FP8's own error is 0.16%; ``docs/transformer_engine.md``).
    Nothing is checked where the maps cannot be read (not Linux)."""
    try:
        with open(maps_path) as maps:
            folders = cudnn_library_folders(maps.read())
    except OSError:
        return
    if len(folders) > 1:
        raise ValueError(f"{FLAG}: this process has cuDNN libraries from {len(folders)} folders "
                         f"({', '.join(folders)}), and cuDNN's FP8 attention is wrong with two cuDNNs; start it "
                         f"with torch's cuDNN folder first on LD_LIBRARY_PATH and CUDNN_HOME set to its parent")


def check_supported(head_dims, device: torch.device) -> None:
    """``ValueError`` naming the flag where cuDNN's FP8 attention cannot run: no CUDA GPU, not
    Hopper (compute capability 9.0), no cuDNN frontend, a head dim it does not take, or cuDNN
    libraries from two folders in the process (``check_one_cudnn``)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"{FLAG} needs a CUDA GPU (Hopper, compute capability 9.0); this process has none")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        raise ValueError(f"{FLAG} runs cuDNN's FP8 attention on Hopper (compute capability 9.0) only; this GPU "
                         f"is {major}.{minor}")
    try:
        importlib.import_module("cudnn")  # nvidia-cudnn-frontend
    except ImportError as err:
        raise ValueError(f"{FLAG} needs the nvidia-cudnn-frontend package (import cudnn: {err})") from err
    for dim in sorted(set(head_dims)):
        if dim % 16 or not 16 <= dim <= 256:
            raise ValueError(f"{FLAG}: cuDNN's FP8 attention takes head dims that are multiples of 16 up to "
                             f"256, and this model's full attention has head dim {dim}")
    check_one_cudnn()


MAX_GRAPHS = 64
"""cuDNN graphs kept (the least recently used goes first): one per shape of call, and a run's
shapes are few (its whole page blocks, its chunk length, the last blocks and chunks)."""
_GRAPHS: "OrderedDict" = OrderedDict()
_HANDLES: dict = {}


def _handle(device: torch.device):
    """This device's cuDNN handle, bound to torch's current stream (the calls order with torch's)."""
    import cudnn

    if device not in _HANDLES:
        _HANDLES[device] = cudnn.create_handle()
    cudnn.set_stream(handle=_HANDLES[device], stream=torch.cuda.current_stream(device).cuda_stream)
    return _HANDLES[device]


def _graph(q8, k8, v8, attn_scale: float, causal: bool):
    """The cuDNN frontend graph of one ``sdpa_fp8`` call of these shapes and strides (built once,
    kept): inputs q, k, v (E4M3) and the six scalars, outputs O (E4M3) and the stats (fp32)."""
    key = (tuple(q8.shape), q8.stride(), tuple(k8.shape), k8.stride(), v8.stride(), attn_scale, causal, q8.device)
    if key in _GRAPHS:
        _GRAPHS.move_to_end(key)
        return _GRAPHS[key]
    try:
        built = _build(q8, k8, v8, attn_scale, causal)
    except Exception as err:  # cuDNN's errors are of its own types; an old frontend's a TypeError
        raise ValueError(f"{FLAG}: cuDNN cannot run FP8 attention of q {tuple(q8.shape)}, k {tuple(k8.shape)} "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from err
    check_one_cudnn()  # building a graph loads cuDNN's engine libraries: from the same folder?
    _GRAPHS[key] = built
    while len(_GRAPHS) > MAX_GRAPHS:
        _GRAPHS.popitem(last=False)
    return built


def _build(q8, k8, v8, attn_scale: float, causal: bool):
    """Build the graph of ``_graph`` (cuDNN frontend)."""
    import cudnn

    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32,
                          handle=_handle(q8.device))
    q_t, k_t, v_t = (graph.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=e4m3)
                     for n, t in (("q", q8), ("k", k8), ("v", v8)))
    scalars = [graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
               for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
    o_t, stats_t, amax_s_t, amax_o_t = graph.sdpa_fp8(
        q=q_t, k=k_t, v=v_t, descale_q=scalars[0], descale_k=scalars[1], descale_v=scalars[2],
        descale_s=scalars[3], scale_s=scalars[4], scale_o=scalars[5], generate_stats=True,
        attn_scale=attn_scale, use_causal_mask=causal, name="capture_sdpa_fp8")
    b, h, s, _ = q8.shape
    o_t.set_output(True).set_dim([b, h, s, v8.shape[-1]]).set_stride([h * s * v8.shape[-1], s * v8.shape[-1],
                                                                      v8.shape[-1], 1]).set_data_type(e4m3)
    stats_t.set_output(True).set_dim([b, h, s, 1]).set_stride([h * s, s, 1, 1]).set_data_type(fp32)
    for amax in (amax_s_t, amax_o_t):
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, (q_t, k_t, v_t, *scalars, o_t, stats_t, amax_s_t, amax_o_t)


def cudnn_sdpa_fp8(q8, k8, v8, descale_q, descale_k, descale_v, scale_s, scale_o, attn_scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One cuDNN ``sdpa_fp8`` forward: ``q8 [b, h, s, d]``, ``k8/v8 [b, groups, t, d]`` (E4M3,
    native GQA; causal top-left) -> ``(O [b, h, s, d_v] E4M3 at scale scale_o, lse [b, h, s] fp32)``."""
    graph, (q_t, k_t, v_t, dq_t, dk_t, dv_t, ds_t, ss_t, so_t, o_t, stats_t, amax_s_t, amax_o_t) = \
        _graph(q8, k8, v8, attn_scale, causal)
    b, h, s, _ = q8.shape
    out = torch.empty(b, h, s, v8.shape[-1], dtype=q8.dtype, device=q8.device)
    stats = torch.empty(b, h, s, 1, dtype=torch.float32, device=q8.device)
    amax_s, amax_o = (torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q8.device) for _ in range(2))
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=q8.device)
    graph.execute({q_t: q8, k_t: k8, v_t: v8, dq_t: descale_q, dk_t: descale_k, dv_t: descale_v,
                   ds_t: 1.0 / scale_s, ss_t: scale_s, so_t: scale_o, o_t: out, stats_t: stats,
                   amax_s_t: amax_s, amax_o_t: amax_o}, workspace, handle=_handle(q8.device))
    return out, stats[..., 0]


Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _part(kernel: Kernel, q8, descale_q, k_BGTD, v_BGTD, attn_scale, causal, fp8_dtype):
    """One call: ``(out [b, h, s, d_v], lse [b, h, s])`` in fp32 of the E4M3 queries over
    ``k/v`` (cast here, each with its own scale; ``V`` centred on its mean per KV head, which is
    added back to the output; ``O`` at the centred ``V``'s scale)."""
    compute = torch.promote_types(v_BGTD.dtype, torch.float32)  # fp64: the exact-cast tests
    k8, descale_k = cast_fp8(k_BGTD, fp8_dtype)
    mean_BG1D = v_BGTD.mean(dim=2, keepdim=True, dtype=compute).to(v_BGTD.dtype)
    v8, descale_v = cast_fp8(v_BGTD - mean_BG1D, fp8_dtype)
    scale_s = torch.full((1, 1, 1, 1), P_SCALE, dtype=torch.float32, device=q8.device)
    scale_o = 0.5 / descale_v  # |O| <= amax(V) up to P's rounding: one binade of headroom
    out8, lse = kernel(q8, k8, v8, descale_q, descale_k, descale_v, scale_s, scale_o, attn_scale, causal)
    out_BHSD = out8.to(compute) / scale_o.to(compute) + expand_groups(mean_BG1D.to(compute), q8.shape[1])
    return out_BHSD, lse.to(compute)


def fp8_capture_attention(q_SBHD: torch.Tensor, k_SBGD: torch.Tensor, v_SBGD: torch.Tensor,
                          prefix_k_SBGD: Optional[torch.Tensor] = None, prefix_v_SBGD: Optional[torch.Tensor] = None,
                          scale: Optional[float] = None, options: KernelOptions = KernelOptions(), *,
                          kernel: Optional[Kernel] = None,
                          fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """A capture chunk's attention in FP8 (module doc): the queries ``[s, 1, h, d]`` over the
    batch-1 pages ``[p, 1, groups, d]`` (all visible, in blocks of ``options.prefix_block``) and
    the chunk's keys ``[s, 1, groups, d]`` (causal); no autograd. Returns ``[s, 1, h, d_v]`` in the
    queries' dtype. ``kernel`` (default: cuDNN's) and ``fp8_dtype`` let the CPU tier run the same
    orchestration on the emulated kernel."""
    assert kernel is not None or fp8_dtype == torch.float8_e4m3fn, "cuDNN's graph here is E4M3"
    kernel = cudnn_sdpa_fp8 if kernel is None else kernel
    seq, batch, heads, dim = q_SBHD.shape
    if batch != 1:
        raise ValueError(f"{FLAG} captures one prompt at a time, got a batch of {batch}")
    attn_scale = default_scale(scale, dim)
    with torch.no_grad():
        q8_SBHD, descale_q = cast_fp8(q_SBHD, fp8_dtype)
        q8 = q8_SBHD.permute(1, 2, 0, 3)
        out_BHSD, lse_BHS = _part(kernel, q8, descale_q, k_SBGD.permute(1, 2, 0, 3), v_SBGD.permute(1, 2, 0, 3),
                                  attn_scale, True, fp8_dtype)
        pages = 0 if prefix_k_SBGD is None else prefix_k_SBGD.shape[0]
        for start in range(0, pages, options.prefix_block):
            end = min(start + options.prefix_block, pages)
            part = _part(kernel, q8, descale_q, prefix_k_SBGD[start:end].permute(1, 2, 0, 3),
                         prefix_v_SBGD[start:end].permute(1, 2, 0, 3), attn_scale, False, fp8_dtype)
            out_BHSD, lse_BHS = merge_partials(out_BHSD, lse_BHS, *part)
    return out_BHSD.to(q_SBHD.dtype).permute(2, 0, 1, 3)


def enable_fp8_capture_attention(model) -> None:
    """Make every full-attention core of ``model`` (this rank's stage) compute its capture with
    ``fp8_capture_attention`` (the cores' ``capture_attention`` hook); ``ValueError`` naming the
    flag where it cannot run (``check_supported``), under context parallelism (whose capture
    attention stays bf16), or for a model without such a layer (GLM-5's MLA/DSA keeps its own)."""
    from megatron.core import parallel_state

    from megatron_longstraw.attention.sdpa_core import SDPACoreAttention

    cores = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
    if parallel_state.model_parallel_is_initialized():
        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1:
            raise ValueError(f"{FLAG} does not run under --context-parallel-size {cp} (the capture's "
                             f"context-parallel attention stays bf16)")
    full_attention = "full_attention" in getattr(model, "hf_config", {}).get("layer_types", ())
    if not cores and full_attention:
        return  # a pipeline stage without the model's full-attention layers: nothing to change here
    if not cores:
        raise ValueError(f"{FLAG}: the model has no full-attention layer it applies to (GLM-5's MLA and DSA "
                         f"attention keep their own kernels)")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    check_supported([core.config.kv_channels for core in cores], device)
    for core in cores:
        core.capture_attention = fp8_capture_attention
