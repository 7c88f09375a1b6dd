# Architecture and precision arguments for Qwen3.6-27B (64 layers: 48 Gated DeltaNet + 16 gated
# attention). Sourced by the launch scripts, as Megatron users keep model args in their own file.
MODEL_ARGS=(
    --model qwen3.6-27b
    --max-position-embeddings 2097152
    --bf16
    --transformer-impl local
)
