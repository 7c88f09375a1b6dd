"""LongStraw execution: detached prompt capture and serial response replay.

``capture_prompt`` runs the prompt once under ``no_grad`` in chunks and keeps, per layer, only
the state the layer needs at the prompt boundary (``state.py``). ``replay_responses`` then
trains each response (or micro-batch of responses) against that detached state. Layers that
own state implement ``binding.StatefulModule``; ``binding.bind`` tells them what to do.
"""
