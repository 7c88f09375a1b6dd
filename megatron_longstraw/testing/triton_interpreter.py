"""Running the project's Triton kernels in Triton's CPU interpreter (the CPU tier's kernel tests).

``run_interpreted(source)`` runs ``source`` in a fresh Python with ``TRITON_INTERPRET=1`` (the
variable must be set before Triton loads, hence the process) and returns its completed process;
``patch_loop_bounds()``, called first by a source whose kernels loop over a scalar argument,
works around a Triton 3.6 interpreter defect: a scalar argument used as a loop bound becomes a Python int by ``int()`` of a
one-element array, which numpy >= 2.5 refuses, so it is converted with ``.item()`` instead.
The interpreter reads bf16 as raw bits: bf16 runs in the GPU tier.
"""

import os
import subprocess
import sys


def patch_loop_bounds() -> None:
    """Let the interpreter take scalar arguments as loop bounds under numpy >= 2.5."""
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = _patch_lang_tensor


def run_interpreted(source: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``source`` run by a fresh interpreter of this Python with Triton's CPU interpreter on."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    return subprocess.run([sys.executable, "-c", source], env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout)
