"""Tooling that serves scripts, not ``import mpkern``: the GPU check (:mod:`tools.gpu_check`)."""
