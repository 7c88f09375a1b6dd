"""What layers and orchestration share: the prompt-state containers, the binding that tells a
stateful layer what to do, and the context-parallel collectives. Imports nothing of the package
above it (``attention/``, ``models/`` and ``longstraw/`` build on it)."""
