// mpkern per-element math, shared by the CPU and CUDA kernels: header-only, no torch headers. Every
// function is `MPK_HD` (__host__ __device__ inline under nvcc, plain inline elsewhere), so the CPU tests
// run exactly the arithmetic the GPU runs; mpkern.triton_kernels and mpkern/reference_codecs.py mirror it.
// Formats: docs/storage.md, "Formats, bit by bit". Arithmetic: docs/design.md, "The per-element arithmetic".
//
// One header per job, included here in this order: floats.h, adamw.h, rng.h, ladder.h.
#pragma once

#include "floats.h"
#include "adamw.h"
#include "rng.h"
#include "ladder.h"
