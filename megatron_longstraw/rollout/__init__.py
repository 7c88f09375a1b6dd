"""Rollouts from a captured prompt: G samples decoded together against one shared prompt state.

``sampling`` holds the pure next-token sampling functions (temperature, top-p, greedy);
``generate.generate_from_state`` runs the batched decode loop (``longstraw.decode_step``).
"""
