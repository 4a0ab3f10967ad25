"""Two fixes for the Triton interpreter (``TRITON_INTERPRET=1``): its scalar ``__index__`` with NumPy >= 2.4
(Triton 3.6, torch 2.11), and its ``tl.fma``, which rounds twice.

**fma** (:func:`apply_exact_fma`). The interpreter computes ``tl.fma(x, y, z)`` as ``x * y + z`` in the
operands' NumPy dtype -- the product rounded, then the sum (Triton 3.6 to 3.8) -- where a GPU's fma
rounds once, and mpkern's kernels rely on the one rounding (math.h's AdamW update). Where the probe sees
the two roundings, the interpreter's ``create_fma`` is replaced, for float32 and float16 operands, by
the exact form: the product in float64 (exact), the sum rounded to odd there (a two-sum gives its
error; an inexact sum with an even last bit moves one float64 ulp towards the exact value), then
rounded to the operands' dtype -- the correctly rounded fma (53 >= 24 + 2 bits). Other dtypes keep
the interpreter's own.

**__index__** (:func:`apply`).

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
_FMA_MARK = "_mpkern_exact_fma"


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


def _fma_rounds_twice(interp) -> bool:
    """Whether the interpreter's fma rounds the product: (1 + 2^-12)^2 - (1 + 2^-11) is 2^-24 in one
    rounding, 0 in two."""
    import numpy as np
    import triton.language as tl

    x = interp.TensorHandle(np.array([1 + 2.0**-12], dtype=np.float32), tl.float32)
    z = interp.TensorHandle(np.array([-(1 + 2.0**-11)], dtype=np.float32), tl.float32)
    return float(interp.InterpreterBuilder.create_fma(None, x, x, z).data[0]) != 2.0**-24


def apply_exact_fma() -> bool:
    """Give the interpreter a one-rounding fma where it rounds twice; True when it is (or was already)
    installed."""
    try:
        from triton.runtime import interpreter as interp

        original = interp.InterpreterBuilder.create_fma
        if getattr(original, _FMA_MARK, False):
            return True
        if not _fma_rounds_twice(interp):
            return False
    except (ImportError, AttributeError, TypeError):  # a Triton without these internals
        return False
    import numpy as np

    def create_fma(self, x, y, z):
        dt = np.result_type(x.data, y.data, z.data)
        if dt not in (np.float32, np.float16):
            return original(self, x, y, z)
        zd = z.data.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            p = x.data.astype(np.float64) * y.data.astype(np.float64)
            s = np.asarray(p + zd)
            bb = s - p
            err = (p - (s - bb)) + (zd - bb)
        bits = s.view(np.int64)
        odd = (err != 0) & (err == err) & ((bits & 1) == 0)  # err is NaN where s is not finite
        bits = np.where(odd, bits + np.where((err > 0) == (s > 0), 1, -1), bits)
        return interp.TensorHandle(np.asarray(bits).view(np.float64).astype(dt), z.dtype.scalar)

    setattr(create_fma, _FMA_MARK, True)
    interp.InterpreterBuilder.create_fma = create_fma
    return True
