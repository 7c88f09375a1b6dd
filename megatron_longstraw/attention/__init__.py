"""The project's attention cores (used in place of Megatron's core attention)."""
