# What a training run reads and writes, from the environment (sourced by the launch scripts after
# the model's MODEL_ARGS; set the ones you need, the rest keep the defaults noted):
#   CHECKPOINT_PATH        where checkpoints go; a relaunch resumes from the newest one there
#   LOAD_PATH              resume from this checkpoint (or save folder) instead
#   PRETRAINED_CHECKPOINT  start from converted HF weights (tools/convert_checkpoint.py hf-to-mcore);
#                          unset: random weights
#   DATA_PATH              prompt JSONL (README: data formats); unset: the synthetic retrieval task
#   TOKENIZER_MODEL        HF tokenizer folder (e.g. the HF checkpoint's); needed with DATA_PATH and
#                          with text in ROLLOUT_PATH
#   REWARD_FN              builtin reward name or module:function (default synthetic_retrieval)
#   ROLLOUT_PATH           prompt groups with their responses from a JSONL file instead of sampling
#                          them (--rollout-source jsonl; the file holds the prompts too)
#   WANDB_PROJECT          wandb project (unset: offline run under the run folder)
# RUN_DIR (set by the launch script) holds the checkpoints, metrics.jsonl and the wandb run.
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$RUN_DIR/checkpoints}
RECIPE_ARGS=(--save "$CHECKPOINT_PATH" --wandb-save-dir "$RUN_DIR" --reward-fn "${REWARD_FN:-synthetic_retrieval}")
if [ -n "${LOAD_PATH:-}" ]; then RECIPE_ARGS+=(--load "$LOAD_PATH"); fi
if [ -n "${PRETRAINED_CHECKPOINT:-}" ]; then
    RECIPE_ARGS+=(--pretrained-checkpoint "$PRETRAINED_CHECKPOINT")
    # the model is then the checkpoint's (its hf_config.json): MODEL_ARGS (sourced before) lose --model
    kept=() skip=0
    for arg in "${MODEL_ARGS[@]}"; do
        if [ "$skip" = 1 ]; then skip=0; elif [ "$arg" = --model ]; then skip=1; else kept+=("$arg"); fi
    done
    MODEL_ARGS=("${kept[@]}")
fi
if [ -n "${DATA_PATH:-}" ]; then
    RECIPE_ARGS+=(--data-path "$DATA_PATH")
    : "${TOKENIZER_MODEL:?set TOKENIZER_MODEL (an HF tokenizer folder) with DATA_PATH}"
fi
if [ -n "${TOKENIZER_MODEL:-}" ]; then
    RECIPE_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
fi
if [ -n "${ROLLOUT_PATH:-}" ]; then RECIPE_ARGS+=(--rollout-source jsonl --rollout-path "$ROLLOUT_PATH"); fi
if [ -n "${WANDB_PROJECT:-}" ]; then RECIPE_ARGS+=(--wandb-project "$WANDB_PROJECT"); fi
