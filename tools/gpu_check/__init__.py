"""The GPU check's tooling (``scripts/gpu_check.sh``): one module per concern.

Run from the repository root as ``python -m tools.gpu_check.<module>``. :mod:`.harness` (stage
files, stack dumps, the end of a stage) and the summary's modules use the standard library only, so
the summary prints even where torch or mpkern cannot be imported.
"""
