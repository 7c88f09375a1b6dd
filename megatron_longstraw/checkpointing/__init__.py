"""Checkpoints: Megatron distributed checkpoints of the project's models and HF conversion."""
