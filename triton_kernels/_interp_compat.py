"""A fix for the Triton interpreter's scalar ``__index__`` with NumPy >= 2.4 (Triton 3.6, torch 2.11).

Under ``TRITON_INTERPRET=1`` every Triton scalar is a one-element NumPy array, and the interpreter
gives ``tl.tensor`` an ``__index__`` that calls ``int()`` on that array -- Python calls it for a
loop bound that is a loaded or computed scalar (``for s in range(lo, hi, N)``, which every mpkern
kernel has). NumPy 2.4 refuses ``int()`` on an array with ndim > 0 ("only 0-dimensional arrays can
be converted to Python scalars"; deprecated since NumPy 1.25), so on Triton 3.6 with NumPy 2.4
every such kernel fails in the interpreter. Triton 3.8 squeezes the array first. It is a CPU-only
problem: compiled kernels on a GPU never run this code.

``apply()`` probes the installed interpreter: only where its ``__index__`` fails on a one-element
array does it wrap the interpreter's patching of ``tl.tensor`` so that ``__index__`` converts the
array's single element (Triton 3.8's behaviour). Anything else -- a Triton without these internals,
a NumPy that still converts, a Triton that already squeezes -- is left untouched. The other
workaround, for code that does not import mpkern's kernels: ``numpy<2.4`` with ``triton<3.8``.
"""

from __future__ import annotations

import operator
import warnings

_MARK = "_mpkern_index_fix"


def _index_of_single_element(self) -> int:
    return int(self.handle.data.reshape(()))


def _interpreter_index_fails(interp) -> bool:
    """Whether the interpreter's own ``tl.tensor.__index__`` raises on a one-element scalar."""
    import numpy as np
    import triton.language as tl

    scope = interp._LangPatchScope()
    try:
        interp._patch_lang_tensor(tl.tensor, scope)
        scalar = tl.tensor(interp.TensorHandle(np.array([3], dtype=np.int32), tl.int32), tl.int32)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # NumPy 1.25-2.3 warn where 2.4 raises
            return operator.index(scalar) != 3
    except (TypeError, DeprecationWarning):
        return True
    finally:
        scope.restore()


def apply() -> bool:
    """Install the fix where the interpreter needs it; True when it is (or was already) installed."""
    try:
        from triton.runtime import interpreter as interp

        original = interp._patch_lang_tensor
        if getattr(original, _MARK, False):
            return True
        if not _interpreter_index_fails(interp):
            return False
    except (ImportError, AttributeError):  # a Triton without these internals: nothing to fix here
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index_of_single_element)  # restored with the rest

    setattr(patch_lang_tensor, _MARK, True)
    interp._patch_lang_tensor = patch_lang_tensor
    return True
