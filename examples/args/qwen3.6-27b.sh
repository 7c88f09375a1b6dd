# Architecture and precision arguments for Qwen3.6-27B (64 layers: 48 Gated DeltaNet + 16 gated
# attention). Sourced by the launch scripts, as Megatron users keep model args in their own file.
# YaRN extends the native 262,144 positions as the model card does (factor 4 for ~1M positions);
# the 2M recipe takes factor 8 (2,097,152 positions). The export's config.json carries it.
MODEL_ARGS=(
    --model qwen3.6-27b
    --yarn-factor 8
    --bf16
    --transformer-impl local
)
