"""Megatron's Gated DeltaNet with LongStraw prompt state (recurrent state and conv tail).

``LongStrawGatedDeltaNet`` is Megatron's ``GatedDeltaNet``; unbound, it runs Megatron's own
forward (context parallelism, packed sequences). Bound by ``longstraw.bind``, it runs the same
steps with the kernels' state inputs/outputs in use: capture carries the fp32 recurrent state and
the conv tail from chunk to chunk; replay starts every response from the detached prompt state;
decode carries each sample's own copy of the state (``new_decode_state``) from token to token;
the reference mode detaches the prompt rows of everything that forms that state.
"""

from dataclasses import dataclass

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.ssm.gated_delta_net import gdn as mcore_gdn

from megatron_longstraw.longstraw.binding import Mode, StatefulModule, detach_prefix
from megatron_longstraw.longstraw.state import LayerState


@dataclass
class GatedDeltaState(LayerState):
    """fp32 recurrent state ``[b, heads_v, d_k, d_v]`` after the last prompt token and the conv
    tail, the last ``kernel - 1`` conv inputs ``[b, channels, kernel - 1]`` (this rank's heads)."""

    recurrent_BHKV: torch.Tensor
    conv_tail_BCW: torch.Tensor


def _batch_to(state: torch.Tensor, batch: int) -> torch.Tensor:
    """A prompt state of batch 1 shared by ``batch`` responses (copied: the kernels want it dense)."""
    return state if state.shape[0] == batch else state.expand(batch, *state.shape[1:]).contiguous()


class LongStrawGatedDeltaNet(GatedDeltaNet, StatefulModule):
    """Megatron ``GatedDeltaNet`` that can start from / hand on a prompt state."""

    def new_prompt_state(self, prompt_length: int, batch: int, device) -> GatedDeltaState:
        """Zero state (the state before any token)."""
        return GatedDeltaState(
            torch.zeros(batch, self.num_v_heads_local_tp, self.key_head_dim, self.value_head_dim,
                        dtype=torch.float32, device=device),
            torch.zeros(batch, self.conv_dim_local_tp, self.conv_kernel_dim - 1,
                        dtype=self.config.params_dtype, device=device),
        )

    def new_decode_state(self, prompt: GatedDeltaState, num_samples: int, capacity: int) -> GatedDeltaState:
        """Each sample's own copy of the prompt's recurrent state and conv tail (it mutates them)."""
        return GatedDeltaState(
            prompt.recurrent_BHKV.expand(num_samples, *prompt.recurrent_BHKV.shape[1:]).clone(),
            prompt.conv_tail_BCW.expand(num_samples, *prompt.conv_tail_BCW.shape[1:]).clone(),
        )

    def forward(self, hidden_states, attention_mask, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None, **kwargs):
        """Megatron's forward when unbound; the stateful forward when bound (see module doc)."""
        binding = self.longstraw
        if binding is None:
            return super().forward(hidden_states, attention_mask, inference_context, packed_seq_params,
                                   sequence_len_offset, inference_params=inference_params, **kwargs)
        if self.cp_size > 1 or packed_seq_params is not None:
            raise ValueError("LongStraw Gated DeltaNet: context parallelism and packed sequences "
                             "are not supported in capture/replay yet")
        mode, state = binding.mode, binding.state
        prefix = binding.prefix_length if mode == Mode.REFERENCE else 0
        stateful = mode in (Mode.CAPTURE, Mode.REPLAY, Mode.DECODE)  # starts from the state
        updates = mode in (Mode.CAPTURE, Mode.DECODE)  # hands its final state on

        qkvzba_BSX = self.in_proj(hidden_states)[0].transpose(0, 1)
        batch, seq_len = qkvzba_BSX.shape[:2]
        qkv, gate, beta, alpha = torch.split(qkvzba_BSX, self.feat_dim_split, dim=-1)
        gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)

        conv_state = None
        if stateful:  # fla's conv state is [b, channels, kernel]
            tail = _batch_to(state.conv_tail_BCW, batch)
            conv_state = torch.cat([tail.new_zeros(batch, tail.shape[1], 1), tail], dim=-1)
        qkv, conv_final = mcore_gdn.causal_conv1d(
            x=detach_prefix(qkv, prefix, 1), weight=self.conv1d.weight.squeeze(1),
            bias=self.conv1d.bias if self.conv_bias else None, activation=self.activation,
            initial_state=conv_state, output_final_state=updates,
        )
        query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(
            qkv, gate, batch, seq_len, beta, alpha)
        g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)
        key, value, g, beta = (detach_prefix(t, prefix, 1) for t in (key, value, g, beta))

        recurrent = _batch_to(state.recurrent_BHKV, batch) if stateful else None
        core_out, recurrent_final = self.gated_delta_rule(
            query, key, value, g=g, beta=beta, initial_state=recurrent,
            output_final_state=updates, use_qk_l2norm_in_kernel=False,
        )
        if updates:
            state.recurrent_BHKV.copy_(recurrent_final)
            state.conv_tail_BCW.copy_(conv_final[:, :, 1:])

        norm_out = self._gated_norm_and_a2a(core_out, gate, None, batch, seq_len, None)
        return self.out_proj(norm_out)
