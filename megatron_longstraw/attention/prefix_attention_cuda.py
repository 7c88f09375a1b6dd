"""GPU path of ``prefix_causal_attention``: fused-attention calls merged by log-sum-exp.

Part 1: every new query over the prefix (the prompt state), no mask, in blocks of at most
``LONGSTRAW_PREFIX_BLOCK`` keys (default 262,144). All query heads of a KV group and all samples
of the micro-batch share the same prefix keys, so they are folded into the query length
(``[1, groups, samples * heads_per_group * s, d]``): no copy or head expansion of the prompt
pages. Part 2: the new tokens over themselves, causal (small). Outputs merge exactly with their
log-sum-exps. Backward runs each part's fused backward with the *merged* output and log-sum-exp,
which yields exactly the gradient of one softmax over all parts; the prefix keys/values get no
gradient (their parts' dK/dV are discarded, and blocking bounds those transients).

Kernels: cuDNN SDPA (fastest on Hopper at head dim 128/256) or flash SDPA, both from torch and
both returning the log-sum-exp; ``LONGSTRAW_ATTENTION_BACKEND=cudnn|flash`` chooses.
``emulated`` runs the same kernel interface in plain torch, so the folding, blocking and merge
logic is tested on a CPU (``tests/test_prefix_attention.py``).
"""

import os

import torch

_BACKENDS = ("cudnn", "flash", "emulated")


def _backend() -> str:
    choice = os.environ.get("LONGSTRAW_ATTENTION_BACKEND", "cudnn")
    if choice not in _BACKENDS:
        raise ValueError(f"LONGSTRAW_ATTENTION_BACKEND must be one of {_BACKENDS}, got {choice!r}")
    return choice


def _prefix_block() -> int:
    block = int(os.environ.get("LONGSTRAW_PREFIX_BLOCK", 262_144))
    if block < 1:
        raise ValueError(f"LONGSTRAW_PREFIX_BLOCK must be >= 1, got {block}")
    return block


def prefix_kernel_settings() -> tuple[str, int]:
    """``(backend, prefix block)`` from ``LONGSTRAW_ATTENTION_BACKEND`` / ``LONGSTRAW_PREFIX_BLOCK``."""
    return _backend(), _prefix_block()


def _emulated_scores(q, k, causal, scale):
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _kernel(backend, q, k):
    """The kernel for one part: cuDNN's backward rejects ``s_q = s_kv = 1`` (a response of one
    token over itself), so that part runs on flash, forward and backward alike."""
    if backend == "cudnn" and q.shape[-2] == 1 and k.shape[-2] == 1:
        return "flash"
    return backend


def _forward(backend, q, k, v, causal, scale):
    """(out_BHSD, lse_BHS, aux) with the kernel's bookkeeping for its backward."""
    backend = _kernel(backend, q, k)
    if backend == "emulated":
        scores = _emulated_scores(q, k, causal, scale)
        lse = scores.logsumexp(-1)
        return ((scores - lse[..., None]).exp() @ v.to(scores.dtype)).to(q.dtype), lse, None
    if backend == "cudnn":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)
    else:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
    return out, lse.reshape(q.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset)


def _backward(backend, grad, q, k, v, out, lse, aux, causal, scale):
    """(dq, dk, dv) of one part, given the merged output and log-sum-exp."""
    backend = _kernel(backend, q, k)
    if backend == "emulated":
        scores = _emulated_scores(q, k, causal, scale)
        probs = (scores - lse[..., None]).exp()
        grad, v_, q_, k_ = (t.to(scores.dtype) for t in (grad, v, q, k))
        dprobs = grad @ v_.transpose(-1, -2)
        delta = (grad * out.to(scores.dtype)).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta)
        return ((dscores @ k_) * scale).to(q.dtype), ((dscores.transpose(-1, -2) @ q_) * scale).to(k.dtype), \
            (probs.transpose(-1, -2) @ grad).to(v.dtype)
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    if backend == "cudnn":
        lse = lse.reshape(*lse.shape, 1) if lse.dim() == 3 else lse
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def _fold(x_BHSD, groups):
    """[b, h, s, d] -> [1, groups, b * (h / groups) * s, d] (queries sharing one KV group)."""
    b, h, s, d = x_BHSD.shape
    return x_BHSD.reshape(b, groups, h // groups, s, d).transpose(0, 1).reshape(1, groups, -1, d)


def _unfold(x_1GND, shape_BHSD):
    b, h, s, d = shape_BHSD
    groups = x_1GND.shape[1]
    return x_1GND.reshape(groups, b, h // groups, s, -1).transpose(0, 1).reshape(b, h, s, -1)


def _blocks(pk_1GPD, block):
    return [(start, min(start + block, pk_1GPD.shape[2])) for start in range(0, pk_1GPD.shape[2], block)]


def merge_prefix_blocks(backend, block, q_BHSD, pk_1GPD, pv_1GPD, scale, acc_BHSD, lse_BHS):
    """Fold ``q_BHSD`` over the batch-1 prefix ``pk/pv_1GPD`` (no mask) ``block`` keys at a time and
    merge each block into the running output ``acc_BHSD`` (fp32) and log-sum-exp ``lse_BHS``.

    Returns ``(acc, lse, q1, aux_per_block)``: ``q1`` is the folded query and ``aux_per_block``
    the kernels' bookkeeping, both for the backward. The prefix is never expanded or copied per
    sample or head: the queries that share a KV group are folded into one query sequence.
    """
    groups = pk_1GPD.shape[1]
    q1 = _fold(q_BHSD, groups)
    aux_prefix = []
    for start, end in _blocks(pk_1GPD, block):
        out_b, lse_b, aux = _forward(backend, q1, pk_1GPD[:, :, start:end], pv_1GPD[:, :, start:end],
                                     False, scale)
        aux_prefix.append(aux)
        out_b = _unfold(out_b, q_BHSD.shape)
        lse_b = _unfold(lse_b.unsqueeze(-1), q_BHSD.shape).squeeze(-1)
        merged = torch.logaddexp(lse_BHS, lse_b)
        acc_BHSD = (acc_BHSD * (lse_BHS - merged).exp().unsqueeze(-1)
                    + out_b.to(acc_BHSD.dtype) * (lse_b - merged).exp().unsqueeze(-1))
        lse_BHS = merged
    return acc_BHSD, lse_BHS, q1, aux_prefix


class _PrefixCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHSD, k_BHSD, v_BHSD, pk_1GPD, pv_1GPD, scale):
        backend, block = _backend(), _prefix_block()
        out, lse, aux_new = _forward(backend, q_BHSD, k_BHSD, v_BHSD, True, scale)
        q1, aux_prefix = None, []
        if pk_1GPD is not None:
            acc = out.to(torch.promote_types(out.dtype, torch.float32))
            acc, lse, q1, aux_prefix = merge_prefix_blocks(backend, block, q_BHSD, pk_1GPD, pv_1GPD, scale,
                                                           acc, lse)
            out = acc.to(q_BHSD.dtype)
        ctx.save_for_backward(q_BHSD, k_BHSD, v_BHSD, pk_1GPD, pv_1GPD, out, lse, q1)
        ctx.aux = (aux_new, aux_prefix)
        ctx.scale, ctx.backend, ctx.block = scale, backend, block
        return out

    @staticmethod
    def backward(ctx, grad_BHSD):
        q, k, v, pk, pv, out, lse, q1 = ctx.saved_tensors
        aux_new, aux_prefix = ctx.aux
        grad_BHSD = grad_BHSD.contiguous()
        dq, dk, dv = _backward(ctx.backend, grad_BHSD, q, k, v, out, lse, aux_new, True, ctx.scale)[:3]
        if pk is not None:
            dq = dq + prefix_blocks_dq(ctx.backend, ctx.block, grad_BHSD, q, q1, pk, pv, out, lse, aux_prefix,
                                       ctx.scale)
        return dq, dk, dv, None, None, None


def prefix_blocks_dq(backend, block, grad_BHSD, q_BHSD, q1, pk_1GPD, pv_1GPD, out_BHSD, lse_BHS, aux_blocks,
                     scale) -> torch.Tensor:
    """The query gradient ``[b, h, s, d]`` of the prefix part, block by block, given the merged
    output and log-sum-exp (the forward's ``merge_prefix_blocks`` folded queries and saved ``aux``)."""
    groups = pk_1GPD.shape[1]
    grad1, out1 = _fold(grad_BHSD, groups), _fold(out_BHSD, groups)
    lse1 = _fold(lse_BHS.unsqueeze(-1), groups).squeeze(-1).contiguous()
    dq = torch.zeros_like(q_BHSD)
    for (start, end), aux in zip(_blocks(pk_1GPD, block), aux_blocks):
        dq1 = _backward(backend, grad1, q1, pk_1GPD[:, :, start:end], pv_1GPD[:, :, start:end], out1, lse1,
                        aux, False, scale)[0]
        dq = dq + _unfold(dq1, q_BHSD.shape)
    return dq


def prefix_causal_attention_cuda(q_SBHD, k_SBGD, v_SBGD, prefix_k_SBGD=None, prefix_v_SBGD=None,
                                 scale=None):
    """See ``prefix_attention.prefix_causal_attention``; returns ``[s, b, h, d_v]``."""
    seq, batch, heads, dim = q_SBHD.shape
    scale = dim ** -0.5 if scale is None else scale
    q_BHSD = q_SBHD.permute(1, 2, 0, 3)
    groups = k_SBGD.shape[2]
    k_BHSD = k_SBGD.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1)
    v_BHSD = v_SBGD.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1)
    pk = pv = None
    if prefix_k_SBGD is not None and prefix_k_SBGD.shape[0] > 0:
        if prefix_k_SBGD.shape[1] != 1:
            raise ValueError("prefix attention (GPU): the prompt state must have batch 1")
        pk = prefix_k_SBGD.permute(1, 2, 0, 3)
        pv = prefix_v_SBGD.permute(1, 2, 0, 3)
    out_BHSD = _PrefixCausalAttention.apply(q_BHSD.contiguous(), k_BHSD.contiguous(),
                                            v_BHSD.contiguous(), pk, pv, scale)
    return out_BHSD.permute(2, 0, 1, 3)
