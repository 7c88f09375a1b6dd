"""GRPO math as pure tensor functions: advantages, clipped surrogate, KL/entropy, aggregation."""
