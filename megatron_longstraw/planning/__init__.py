"""The fixed-budget planner: does a run fit on these GPUs, with which layout, how long a step takes.

``hardware.py`` (the GPUs), ``kernels.py`` (kernel rates measured on an H200), ``memory.py`` and
``timing.py`` (per-GPU peak and per-step times of one layout, pure functions of a
``models/profile.py`` ``ModelProfile``), ``layouts.py`` (the valid layouts of a GPU count),
``planner.py`` (every layout's plan, the fastest that fits, the largest prompt that fits),
``measured.py`` (the benchmark's runs beside their plans) and ``calibration.py`` (the kernel
rates read off those runs).
``tools/plan_budget.py`` is its command line; the trainer checks its own layout with it.
"""
