"""A step's metrics over its prompt groups and data-parallel ranks; throughput and MFU."""

from typing import Sequence

import torch
from megatron.core import parallel_state

from megatron_longstraw.distributed import device
from megatron_longstraw.longstraw.cost_model import prompt_flops, response_forward_flops

# summed over the step's groups and ranks, with the loss's own ``summed_metrics``; "*_max" / "*_min"
# and "*/max" / "*/min" keys take the extreme; everything else is the mean over groups
SUMMED = ("tokens/response",)


def _reduction(key: str, summed: Sequence[str] = ()) -> str:
    if key in SUMMED or key in summed:
        return "sum"
    if key.endswith(("/max", "_max")):
        return "max"
    if key.endswith(("/min", "_min")):
        return "min"
    return "mean"


def reduce_step_metrics(groups: list[dict], summed: Sequence[str] = ()) -> dict:
    """Reduce this rank's group metrics over the step and the data-parallel ranks (every rank
    gets the result); ``summed``: keys summed besides ``SUMMED`` (the loss's ``summed_metrics``).
    Keys are agreed over the ranks first, so a key some rank lacks is fine."""
    dp_group = parallel_state.get_data_parallel_group()
    keys = sorted(set().union(*groups))
    if torch.distributed.get_world_size(dp_group) > 1:
        every = [None] * torch.distributed.get_world_size(dp_group)
        torch.distributed.all_gather_object(every, keys, group=dp_group)
        keys = sorted(set().union(*every))
    local = torch.tensor([[g.get(k, float("nan")) for k in keys] for g in groups], dtype=torch.float64,
                         device=device())
    present = ~local.isnan()
    sums = torch.cat([local.nan_to_num(0.0).sum(0), present.sum(0).double()])
    highs = local.nan_to_num(float("-inf")).amax(0)
    lows = local.nan_to_num(float("inf")).amin(0)
    if torch.distributed.get_world_size(dp_group) > 1:
        torch.distributed.all_reduce(sums, group=dp_group)
        torch.distributed.all_reduce(highs, op=torch.distributed.ReduceOp.MAX, group=dp_group)
        torch.distributed.all_reduce(lows, op=torch.distributed.ReduceOp.MIN, group=dp_group)
    out = {}
    for i, key in enumerate(keys):
        count = sums[len(keys) + i].item()
        if count == 0:
            continue
        how = _reduction(key, summed)
        value = {"sum": sums[i], "max": highs[i], "min": lows[i], "mean": sums[i] / count}[how]
        out[key] = value.item()
    out["reward/zero_std_frac"] = out.pop("reward/zero_std_groups", float("nan"))
    return out


def throughput_metrics(hf: dict, model, groups: list[dict], phase_times: dict, peak_tflops: float,
                       dropped: Sequence[dict] = ()) -> dict:
    """Tokens/s per phase (this rank) and, on a GPU, MFU against ``peak_tflops`` (``--peak-tflops``) of capture and
    replay (forward + backward: 3x the forward), each where the model's family has that FLOPs
    formula. Under context parallelism a rank's capture MFU counts its share (1/CP) of the
    prompt's FLOPs. ``dropped``: the capture and rollout work of groups dynamic sampling dropped
    (``{"prompt/length", "tokens/response"}``), which the capture and rollout times include."""
    prompt_tokens = sum(g["prompt/length"] for g in groups)
    response_tokens = sum(g["tokens/response"] for g in groups)
    dropped_prompt = sum(d["prompt/length"] for d in dropped)
    dropped_response = sum(d["tokens/response"] for d in dropped)
    out = {}
    for phase, tokens in (("capture", prompt_tokens + dropped_prompt), ("rollout", response_tokens + dropped_response),
                          ("scoring", response_tokens), ("replay", response_tokens)):
        seconds = phase_times.get(f"time/{phase}_s")
        if seconds:
            out[f"throughput/{phase}_tokens_per_s"] = tokens / seconds
    if not torch.cuda.is_available():
        return out
    flops = {}
    per_prompt = [prompt_flops(hf, model, int(g["prompt/length"])) for g in [*groups, *dropped]]
    if all(f is not None for f in per_prompt):
        flops["capture"] = sum(per_prompt) / parallel_state.get_context_parallel_world_size()
    per_response = [response_forward_flops(hf, model, int(g["prompt/length"]), int(g["tokens/response"]))
                    for g in groups]
    if all(f is not None for f in per_response):
        flops["replay"] = sum(3 * f for f in per_response)
    for phase, total in flops.items():
        seconds = phase_times.get(f"time/{phase}_s")
        if seconds:
            out[f"mfu/{phase}"] = total / seconds / (peak_tflops * 1e12)
    return out
