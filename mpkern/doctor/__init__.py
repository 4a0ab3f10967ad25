"""The mixed-precision doctor: where fp16/bf16 breaks a model, why, and what to change.

* :func:`diagnose` -- the model in fp32 and in a 16-bit recipe on the same inputs, module by module:
  own error (on the fp32 input), accumulated error, range (headroom, inf/NaN appearing, values
  below the smallest normal) and, with a loss, every gradient at the loss scale; findings with fixes.
* :class:`Diagnosis` -- the result: ``layers``, ``grads``, ``findings``, ``first_overflow``,
  ``to_dict()``, a text table (``str()``), ``plot()``.
* ``mpkern doctor`` (CLI) -- the built-in compare model and a Hugging Face model from a config.
* :func:`nonfinite_report` -- after the fact: which gradients of an :func:`mpkern.unscale_` result
  held inf/NaN, likeliest culprit first (``mpkern.nonfinite_report``).
"""

from .nonfinite import NonfiniteEntry, NonfiniteReport, nonfinite_report
from .result import Diagnosis, Finding, GradStats, LayerStats
from .run import RECIPES, diagnose

__all__ = ["Diagnosis", "Finding", "GradStats", "LayerStats", "RECIPES", "diagnose", "NonfiniteEntry",
           "NonfiniteReport", "nonfinite_report"]
