"""The registered policy losses, one file each; every module here is imported when a loss is first
looked up (``grpo/registry.py``), and registers its class with ``@register_policy_loss``."""
