# Architecture and precision arguments for GLM-5 (78 layers: MLA + DSA indexer, MoE with 256
# routed experts). Sourced by the launch scripts.
MODEL_ARGS=(
    --model glm-5
    --max-position-embeddings 2097152
    --bf16
    --transformer-impl local
)
