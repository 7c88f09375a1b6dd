# The tiny hybrid debug model (Qwen3.5 layout: Gated DeltaNet + gated attention), fp32.
MODEL_ARGS=(
    --model qwen3.5-debug
)
