// The eager fast path of FusedAdamWMP.step(): a cache of the prepared kernel argument lists.
//
// mpkern/optim/__init__.py builds a StepCache after a full (reference) step whose buckets are
// all plain, dense, contiguous and on one device with a native backend. Each later eager step
// calls refresh(): one loop over every param of every group that checks, without building any
// Python object, that nothing the full path would look at has changed --
//   * the group param lists (length, identity of each param, exact Python type),
//   * no `main_grad` in the param's __dict__ (None counts as absent),
//   * grad present exactly where it was; its layout, dtype, device, shape and contiguity,
//   * each param's stamp (version counter, data pointer), sizes, strides, dtype, device,
//   * the optimizer's state dict and each param's state dict unchanged (CPython dict version
//     tags: any insertion, deletion or replacement of a value changes them),
// and gathers the grads into the cached lists. Any difference returns false and the caller runs
// the full path (which then builds a new cache). grad_stats() / adamw() call the CPU or CUDA
// kernels directly with the cached std::vector<at::Tensor> (no torch.ops list conversion);
// release() drops the grad references so a cache never keeps grads alive between steps.
#include "fastpath.h"

#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>
#include <tuple>
#include <vector>

#include "adamw_common.h"

namespace mpkern {
namespace cpu {
void adamw_step_cpu_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters,
                     at::TensorList steps, const at::Tensor& grad_factor, const at::Tensor& found_inf,
                     const std::optional<at::Tensor>& lr_tensor, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool maximize, int64_t master_mode, bool stochastic_rounding,
                     int64_t seed, at::IntArrayRef stream_ids, at::IntArrayRef elem_offsets,
                     const std::optional<at::TensorList>& exp_avg_scales_opt,
                     const std::optional<at::TensorList>& exp_avg_sq_scales_opt);
std::tuple<at::Tensor, at::Tensor> grad_stats_cpu(at::TensorList grads, const at::Tensor& inv_scale);
}  // namespace cpu
#if defined(MPKERN_WITH_CUDA) && MPKERN_WITH_CUDA
namespace cuda {
void adamw_step_cuda_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters,
                      at::TensorList steps, const at::Tensor& grad_factor, const at::Tensor& found_inf,
                      const std::optional<at::Tensor>& lr_tensor, double lr, double beta1, double beta2, double eps,
                      double weight_decay, bool maximize, int64_t master_mode, bool stochastic_rounding,
                      int64_t seed, at::IntArrayRef stream_ids, at::IntArrayRef elem_offsets,
                      const std::optional<at::TensorList>& exp_avg_scales_opt,
                      const std::optional<at::TensorList>& exp_avg_sq_scales_opt);
std::tuple<at::Tensor, at::Tensor> grad_stats_cuda(at::TensorList grads, const at::Tensor& inv_scale);
}  // namespace cuda
#endif

namespace {

namespace py = pybind11;

// Dict version tags: CPython 3.11 and 3.12 keep one per dict (changed by every mutation). Other
// versions: no fast path (step_cache_supported() is false, the optimizer never builds a cache).
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
constexpr bool kDictVersions = true;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
inline uint64_t dict_version(PyObject* d) { return reinterpret_cast<PyDictObject*>(d)->ma_version_tag; }
#pragma GCC diagnostic pop
#else
constexpr bool kDictVersions = false;
inline uint64_t dict_version(PyObject*) { return 0; }
#endif

inline bool has_python_key(const at::Tensor& t) { return t.key_set().has(c10::DispatchKey::Python); }

struct Bucket {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, mscales, vscales;
  std::vector<int64_t> stream_ids, elem_offsets;
  int64_t mode = 0;
  bool scaled = false;
  size_t stats_offset = 0;  // where its grads start in the statistics list
};

// One param of the optimizer, in group order.
struct Entry {
  PyObject* param = nullptr;   // strong reference (held by `refs_`)
  PyTypeObject* type = nullptr;
  PyObject* pdict = nullptr;   // the param's __dict__ (main_grad lives there)
  PyObject* sdict = nullptr;   // its state dict (stepped params only)
  uint64_t sversion = 0;
  int32_t bucket = -1;         // -1: no grad when cached (must still have none)
  int32_t pos = 0;             // index in its bucket
  int64_t version = 0;
  const void* data = nullptr;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kFloat, gdtype = at::kFloat;
};

class StepCache {
 public:
  StepCache(py::list group_lists, py::list params, py::list param_dicts, py::list state_dicts, py::object state,
            std::vector<int64_t> bucket_of, std::vector<int64_t> pos_of, bool cuda)
      : cuda_(cuda) {
    const size_t n = static_cast<size_t>(py::len(params));
    TORCH_CHECK(py::len(param_dicts) == n && py::len(state_dicts) == n && bucket_of.size() == n && pos_of.size() == n,
                "StepCache: per-param lists differ in length");
    for (auto l : group_lists) {
      TORCH_CHECK(PyList_Check(l.ptr()), "StepCache: group params must be lists");
      lists_.push_back(py::reinterpret_borrow<py::object>(l));
      lens_.push_back(PyList_GET_SIZE(l.ptr()));
    }
    state_ = state;
    state_version_ = dict_version(state.ptr());
    entries_.resize(n);
    for (size_t k = 0; k < n; ++k) {
      Entry& e = entries_[k];
      py::object p = params[k], d = param_dicts[k], s = state_dicts[k];
      TORCH_CHECK(THPVariable_Check(p.ptr()) && PyDict_Check(d.ptr()), "StepCache: bad param entry");
      refs_.push_back(p);
      refs_.push_back(d);
      e.param = p.ptr();
      e.type = Py_TYPE(p.ptr());
      e.pdict = d.ptr();
      e.bucket = static_cast<int32_t>(bucket_of[k]);
      e.pos = static_cast<int32_t>(pos_of[k]);
      if (e.bucket < 0) continue;
      TORCH_CHECK(PyDict_Check(s.ptr()), "StepCache: a stepped param needs its state dict");
      refs_.push_back(s);
      e.sdict = s.ptr();
      e.sversion = dict_version(s.ptr());
      const at::Tensor& t = THPVariable_Unpack(p.ptr());
      e.version = t._version();
      e.data = t.data_ptr();
      e.sizes = t.sizes().vec();
      e.strides = t.strides().vec();
      e.dtype = t.scalar_type();
      const at::Tensor& g = t.grad();
      TORCH_CHECK(g.defined(), "StepCache: a stepped param needs a grad");
      e.gdtype = g.scalar_type();
      device_ = t.device();
    }
    main_grad_ = py::reinterpret_steal<py::object>(PyUnicode_InternFromString("main_grad"));
  }

  void add_bucket(std::vector<at::Tensor> params, std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
                  std::vector<at::Tensor> max_exp_avg_sqs, std::vector<at::Tensor> masters,
                  std::vector<at::Tensor> steps, std::optional<std::vector<at::Tensor>> mscales,
                  std::optional<std::vector<at::Tensor>> vscales, std::vector<int64_t> stream_ids,
                  std::vector<int64_t> elem_offsets, int64_t mode) {
    Bucket b;
    b.grads.resize(params.size());
    b.params = std::move(params);
    b.exp_avgs = std::move(exp_avgs);
    b.exp_avg_sqs = std::move(exp_avg_sqs);
    b.max_exp_avg_sqs = std::move(max_exp_avg_sqs);
    b.masters = std::move(masters);
    b.steps = std::move(steps);
    b.scaled = mscales.has_value();
    if (b.scaled) {
      b.mscales = std::move(*mscales);
      b.vscales = std::move(*vscales);
    }
    b.stream_ids = std::move(stream_ids);
    b.elem_offsets = std::move(elem_offsets);
    b.mode = mode;
    b.stats_offset = stats_.size();
    stats_.resize(stats_.size() + b.params.size());
    buckets_.push_back(std::move(b));
  }

  // True (grads gathered) if nothing the full path looks at has changed since the cache was built.
  bool refresh() {
    if (!kDictVersions || dict_version(state_.ptr()) != state_version_) return false;
    size_t k = 0;
    for (size_t li = 0; li < lists_.size(); ++li) {
      PyObject* l = lists_[li].ptr();
      const Py_ssize_t n = PyList_GET_SIZE(l);
      if (n != lens_[li]) return fail();
      for (Py_ssize_t i = 0; i < n; ++i, ++k) {
        const Entry& e = entries_[k];
        PyObject* o = PyList_GET_ITEM(l, i);
        if (o != e.param || Py_TYPE(o) != e.type) return fail();
        PyObject* mg = PyDict_GetItemWithError(e.pdict, main_grad_.ptr());  // borrowed
        if (mg == nullptr && PyErr_Occurred()) {
          PyErr_Clear();
          return fail();
        }
        if (mg != nullptr && mg != Py_None) return fail();
        const at::Tensor& t = THPVariable_Unpack(o);
        const at::Tensor& g = t.grad();
        if (e.bucket < 0) {
          if (g.defined()) return fail();
          continue;
        }
        if (!g.defined() || t._version() != e.version || t.data_ptr() != e.data || t.scalar_type() != e.dtype ||
            t.device() != device_ || !t.sizes().equals(e.sizes) || !t.strides().equals(e.strides))
          return fail();
        if (g.layout() != at::kStrided || g.scalar_type() != e.gdtype || g.device() != device_ ||
            !g.sizes().equals(e.sizes) || !g.is_contiguous() || has_python_key(g))
          return fail();
        if (dict_version(e.sdict) != e.sversion) return fail();
        Bucket& b = buckets_[e.bucket];
        b.grads[e.pos] = g;
        stats_[b.stats_offset + e.pos] = g;
      }
    }
    if (k != entries_.size()) return fail();
    return true;
  }

  std::tuple<at::Tensor, at::Tensor> grad_stats(const at::Tensor& inv_scale) {
    py::gil_scoped_release nogil;
#if defined(MPKERN_WITH_CUDA) && MPKERN_WITH_CUDA
    if (cuda_) return cuda::grad_stats_cuda(stats_, inv_scale);
#endif
    TORCH_CHECK(!cuda_, "StepCache: this build has no CUDA kernels");
    return cpu::grad_stats_cpu(stats_, inv_scale);
  }

  void adamw(int64_t bi, const at::Tensor& grad_factor, const at::Tensor& found_inf,
             const std::optional<at::Tensor>& lr_tensor, double lr, double beta1, double beta2, double eps,
             double weight_decay, bool maximize, bool stochastic_rounding, int64_t seed) {
    TORCH_CHECK(bi >= 0 && bi < static_cast<int64_t>(buckets_.size()), "StepCache: bad bucket ", bi);
    Bucket& b = buckets_[bi];
    std::optional<at::TensorList> sm, sv;
    if (b.scaled) {
      sm = at::TensorList(b.mscales);
      sv = at::TensorList(b.vscales);
    }
    py::gil_scoped_release nogil;
#if defined(MPKERN_WITH_CUDA) && MPKERN_WITH_CUDA
    if (cuda_) {
      cuda::adamw_step_cuda_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.masters, b.steps,
                             grad_factor, found_inf, lr_tensor, lr, beta1, beta2, eps, weight_decay, maximize, b.mode,
                             stochastic_rounding, seed, b.stream_ids, b.elem_offsets, sm, sv);
      return;
    }
#endif
    TORCH_CHECK(!cuda_, "StepCache: this build has no CUDA kernels");
    cpu::adamw_step_cpu_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.masters, b.steps,
                         grad_factor, found_inf, lr_tensor, lr, beta1, beta2, eps, weight_decay, maximize, b.mode,
                         stochastic_rounding, seed, b.stream_ids, b.elem_offsets, sm, sv);
  }

  // Drop every grad reference (after the step, or after a failed refresh).
  void release() {
    for (auto& b : buckets_)
      for (auto& g : b.grads) g.reset();
    for (auto& g : stats_) g.reset();
  }

  // The gathered grads in statistics order (for tests and for non-native consumers).
  std::vector<at::Tensor> grads() const { return stats_; }
  size_t num_buckets() const { return buckets_.size(); }

 private:
  bool fail() {
    release();
    return false;
  }

  bool cuda_;
  c10::Device device_{c10::DeviceType::CPU};
  std::vector<py::object> lists_, refs_;
  std::vector<Py_ssize_t> lens_;
  py::object state_, main_grad_;
  uint64_t state_version_ = 0;
  std::vector<Entry> entries_;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> stats_;
};

}  // namespace

void register_fastpath(py::module_& mod) {
  mod.def("step_cache_supported", []() { return kDictVersions; },
          "Whether FusedAdamWMP's step cache can run in this Python (it reads dict version tags)");
  py::class_<StepCache>(mod, "StepCache", "Cached kernel argument lists of FusedAdamWMP.step (see csrc/fastpath.cpp)")
      .def(py::init<py::list, py::list, py::list, py::list, py::object, std::vector<int64_t>, std::vector<int64_t>,
                    bool>(),
           py::arg("group_lists"), py::arg("params"), py::arg("param_dicts"), py::arg("state_dicts"),
           py::arg("state"), py::arg("bucket_of"), py::arg("pos_of"), py::arg("cuda"))
      .def("add_bucket", &StepCache::add_bucket, py::arg("params"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
           py::arg("max_exp_avg_sqs"), py::arg("masters"), py::arg("steps"), py::arg("exp_avg_scales"),
           py::arg("exp_avg_sq_scales"), py::arg("stream_ids"), py::arg("elem_offsets"), py::arg("mode"))
      .def("refresh", &StepCache::refresh)
      .def("grad_stats", &StepCache::grad_stats, py::arg("inv_scale"))
      .def("adamw", &StepCache::adamw, py::arg("bucket"), py::arg("grad_factor"), py::arg("found_inf"),
           py::arg("lr_tensor"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("weight_decay"), py::arg("maximize"), py::arg("stochastic_rounding"), py::arg("seed"))
      .def("release", &StepCache::release)
      .def("grads", &StepCache::grads)
      .def_property_readonly("num_buckets", &StepCache::num_buckets);
}

}  // namespace mpkern
