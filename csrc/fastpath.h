// The eager fast path of FusedAdamWMP.step() (csrc/fastpath.cpp): a cache of the prepared kernel
// argument lists of every (group, device, master kind) bucket, re-validated in one C++ loop per
// step, and calls of the registered mpkern ops through typed dispatcher handles with the cached
// lists (no Python list conversion). Registered into the `mpkern._C` module by csrc/ops.cpp.
#pragma once

#include <torch/extension.h>

namespace mpkern {
// Adds the StepCache class to the pybind module.
void register_fastpath(pybind11::module_& mod);
}  // namespace mpkern
