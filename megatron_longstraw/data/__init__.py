"""Data for GRPO: tokenizers (Megatron-Core's), JSONL prompts, the synthetic retrieval task and
external rollouts, all with a checkpointable position (``position.py``)."""

from megatron_longstraw.data.external_rollouts import ExternalRolloutDataset, RolloutGroup
from megatron_longstraw.data.items import PromptItem
from megatron_longstraw.data.position import EpochOrder, PositionedDataset
from megatron_longstraw.data.prompts import PromptDataset, resolve_max_prompt_length
from megatron_longstraw.data.synthetic import (MIN_VOCAB_SIZE, KeyValueRetrievalTask,
                                               SyntheticRetrievalDataset)
from megatron_longstraw.data.tokenizer import SUPPORTED_TOKENIZER_TYPES, Tokenizer, build_tokenizer

__all__ = ["EpochOrder", "ExternalRolloutDataset", "KeyValueRetrievalTask", "MIN_VOCAB_SIZE",
           "PositionedDataset", "PromptDataset", "PromptItem", "RolloutGroup",
           "SUPPORTED_TOKENIZER_TYPES", "SyntheticRetrievalDataset", "Tokenizer",
           "build_tokenizer", "resolve_max_prompt_length"]
