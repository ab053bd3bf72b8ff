"""Triton interpreter setup shared by tests/kernels and tests/integration.

Without CUDA, Triton kernels run in its interpreter: ``TRITON_INTERPRET=1`` is set here before
anything imports triton, unless the environment already decides (``TRITON_INTERPRET=0`` forces
compiled kernels; ``GLM5_FORCE_INTERPRET=1`` forces the interpreter even with a GPU).

Triton 3.6 interpreter fix: with NumPy >= 2.3 its ``tensor.__index__`` fails on runtime-int loop
bounds (``range(0, n)`` with ``n`` a kernel argument: "only 0-dimensional arrays can be converted
to Python scalars"). Triton 3.8 squeezes the value; the same one-line fix is applied to the
interpreter of older Tritons. It changes nothing for compiled kernels.
"""

from __future__ import annotations

import os

_HAS_CUDA = False
try:  # torch may be CPU-only
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a dependency of every kernel test
    torch = None

if os.environ.get("GLM5_FORCE_INTERPRET") == "1":
    os.environ["TRITON_INTERPRET"] = "1"
elif "TRITON_INTERPRET" not in os.environ and not _HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Where the kernel tests put their tensors: CUDA with compiled Triton, else the CPU (interpreter).
DEVICE = "cuda" if (_HAS_CUDA and not INTERPRET) else "cpu"


def _fix_old_interpreter_index() -> None:
    try:
        import triton.runtime.interpreter as interp
    except Exception:  # pragma: no cover - triton missing: tests that need it fail on import
        return
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_glm5_index_fix", False):
        return

    def _patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _patch_lang_tensor._glm5_index_fix = True
    interp._patch_lang_tensor = _patch_lang_tensor


if INTERPRET:
    _fix_old_interpreter_index()
