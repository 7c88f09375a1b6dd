"""Expert-parallel lockstep for the no-grad passes whose count depends on a rank's own data.

Megatron's MoE layers exchange tokens with an all-to-all over the expert-parallel group (with the
expert tensor-parallel ranks: ``get_expert_tensor_and_model_parallel_group``). When that group
spans data-parallel ranks, each rank works on its own prompt group, and two passes have counts of
their own: prompt capture (one model pass per chunk, so per prompt length) and decoding (one per
step, until the group's last sample stops). A rank whose passes end first would leave the others
waiting in an all-to-all that never completes.

``ExpertLockstep`` keeps the group in step: before each of its passes a rank says it is busy (one
all-reduce of a flag over the group); once its own passes are done it keeps answering "idle", and
for every round in which another rank is still busy it runs each of its MoE layers, in layer
order, on one token (``idle_pass``): the same sequence of all-to-alls the busy ranks issue, with
nothing to send. One token, not zero: Megatron's MoE layer does not take an empty input. The idle
passes run without autograd, so the router keeps no counts for them (its expert-bias token counts
and auxiliary losses are taken only with gradients enabled) and no gradient changes.

The reverse sweep of ``--prompt-gradient exact`` (``prompt_backward.py``) recomputes one chunk
per round, forward and backward: a busy rank's MoE layers exchange tokens in layer order, then
gradients in reverse layer order (every MoE layer's backward runs: the sweep makes each chunk's
graph reach the last layer's output). ``ExpertLockstep(model, backward=True)``'s idle pass is the
same with autograd: the MoE layers chained on one zero token, then a backward from a zero
gradient. The zero gradient adds nothing to this rank's parameters, but the busy ranks' tokens
that the idle pass's experts received get their expert-weight gradients, as in a busy round.
Routers keep no token counts for the idle token (restored after the pass); auxiliary and z
losses, which a one-token pass would add, must be off (they are for GLM-5).

Replay and scoring need no lockstep: every rank replays the same number of micro-batches (G and
``--replay-micro-batch-size`` are global). Without expert parallelism, or in a model without MoE
layers, ``ExpertLockstep`` does nothing and costs nothing.
"""

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_layer import MoELayer


def moe_layers(model) -> list[MoELayer]:
    """This rank's (pipeline stage's) MoE layers, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


class ExpertLockstep:
    """Rounds of "who is still busy" over the expert-parallel group (see the module docstring).

    A rank calls ``busy()`` before each pass of its own and ``finish()`` once it has none left;
    ``finish`` returns when every rank of the group has finished. ``backward``: each pass is a
    forward and a backward (the reverse sweep's rounds)."""

    def __init__(self, model, backward: bool = False):
        self.model = model
        self.backward = backward
        self.layers = []
        self.group = None
        if parallel_state.get_expert_tensor_and_model_parallel_world_size() > 1:
            self.layers = moe_layers(model)
            if self.layers:
                self.group = parallel_state.get_expert_tensor_and_model_parallel_group()

    @property
    def active(self) -> bool:
        """Whether this rank shares MoE all-to-alls with other ranks."""
        return self.group is not None

    def _round(self, busy: bool) -> bool:
        flag = torch.tensor([int(busy)], dtype=torch.int32, device=_device(self.model))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def busy(self) -> None:
        """Announce one pass of this rank's own (call right before it)."""
        if self.active:
            self._round(True)

    def finish(self) -> None:
        """This rank has no pass left: run idle passes while any other rank is still busy."""
        if not self.active:
            return
        while self._round(False):
            self.idle_pass()

    def idle_pass(self) -> None:
        """Each MoE layer on one zero token, in layer order (the all-to-alls of one model pass);
        with ``backward`` chained with autograd, then backward from a zero gradient (those of one
        recomputed chunk)."""
        first = self.layers[0]
        hidden_1BH = torch.zeros(1, 1, first.config.hidden_size, dtype=first.config.params_dtype,
                                 device=_device(self.model))
        if not self.backward:
            with torch.no_grad():
                for layer in self.layers:
                    layer(hidden_1BH)
            return
        routers = [layer.router for layer in self.layers]
        assert not any(router.is_aux_loss_enabled() or router.config.moe_z_loss_coeff for router in routers), \
            "a one-token idle pass with autograd would add auxiliary- or z-loss gradients"
        counts = [router.local_tokens_per_expert.clone() if router.local_tokens_per_expert is not None else None
                  for router in routers]
        with torch.enable_grad():
            hidden_1BH.requires_grad_(True)
            out_1BH = hidden_1BH
            for layer in self.layers:
                out_1BH = layer(out_1BH)[0]
            out_1BH.backward(torch.zeros_like(out_1BH))
        for router, count in zip(routers, counts):
            if count is not None:
                router.local_tokens_per_expert.copy_(count)


def _device(model) -> torch.device:
    return next(model.parameters()).device
