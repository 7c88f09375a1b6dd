"""Causal core attention on torch SDPA, in Megatron's ``core_attention`` interface.

Megatron's local ``DotProductAttention`` materializes the full score matrix and allocates on
``torch.cuda.current_device()``; this core calls ``torch.nn.functional.scaled_dot_product_attention``
instead (flash/cuDNN/efficient kernels on GPU, the math path on CPU) and is the place where
prompt-state attention plugs in.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPACoreAttention(MegatronModule):
    """Core attention ``softmax(q k^T * scale) v`` with a causal mask and GQA.

    Takes ``query_SBHD`` ``[s, b, heads, d]`` and ``key/value_SBGD`` ``[s, b, groups, d]``;
    returns ``[s, b, heads * d_v]`` like Megatron's ``DotProductAttention``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        """Causal attention of ``query`` over ``key``/``value`` (see class docstring)."""
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention: packed sequences are not supported")
        q_BHSD, k_BGSD, v_BGSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out_BHSD = F.scaled_dot_product_attention(
            q_BHSD, k_BGSD, v_BGSD, is_causal=True, scale=self.softmax_scale,
            enable_gqa=q_BHSD.shape[1] != k_BGSD.shape[1],
        )
        seq, batch = query.shape[0], query.shape[1]
        return out_BHSD.permute(2, 0, 1, 3).reshape(seq, batch, -1)
