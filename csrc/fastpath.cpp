// The eager fast path of FusedAdamWMP.step(): a cache of the prepared kernel argument lists.
//
// mpkern/optim/runtime.py builds a StepCache after a full step whose buckets are all plain, dense,
// contiguous and on one device with a native backend. Each later eager step calls refresh(): one
// loop over every param of every group that checks, without building any Python object, that
// nothing the full path would look at has changed --
//   * the group param lists (length, identity of each param, exact Python type),
//   * no `main_grad` in the param's __dict__ (None counts as absent),
//   * grad present exactly where it was; its layout, dtype, device, shape and contiguity,
//   * each param's stamp (version counter, data pointer), sizes, strides, dtype, device,
//   * the optimizer's state dict and each param's state dict unchanged: the same keys and value
//     objects in the same order (PyDict_Next over a snapshot that holds them alive, so an object
//     freed and another allocated at its address cannot look unchanged),
// and gathers the grads into the cached lists. Any difference returns false and the caller runs
// the full path (which then builds a new cache). grad_stats() / adamw() call the registered ops
// mpkern::grad_stats / mpkern::adamw_step_ through typed dispatcher handles with the cached
// std::vector<at::Tensor> (no Python list conversion), so the profiler, dispatch modes and every
// kernel registration see them as they see the full path's calls; release() drops the grad
// references so a cache never keeps grads alive between steps.
#include "fastpath.h"

#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace mpkern {
namespace {

namespace py = pybind11;

// A dict's keys and values (borrowed pointers; the owner holds references to all of them).
struct DictSnapshot {
  PyObject* dict = nullptr;
  std::vector<PyObject*> items;  // key, value, key, value, ...

  void take(PyObject* d, std::vector<py::object>& refs) {
    dict = d;
    items.clear();
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &pos, &k, &v)) {
      items.push_back(k);
      items.push_back(v);
      refs.push_back(py::reinterpret_borrow<py::object>(k));
      refs.push_back(py::reinterpret_borrow<py::object>(v));
    }
  }
  // Whether the dict holds the same keys and value objects, in the same order.
  bool same() const {
    if (static_cast<size_t>(PyDict_Size(dict)) * 2 != items.size()) return false;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    size_t i = 0;
    while (PyDict_Next(dict, &pos, &k, &v)) {
      if (k != items[i] || v != items[i + 1]) return false;
      i += 2;
    }
    return true;
  }
};

inline bool has_python_key(const at::Tensor& t) { return t.key_set().has(c10::DispatchKey::Python); }

struct Bucket {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, mscales, vscales;
  std::vector<int64_t> stream_ids, elem_offsets;
  std::string master_codec, moment_codec;
  bool scaled = false;
  size_t stats_offset = 0;  // where its grads start in the statistics list
};

// One param of the optimizer, in group order.
struct Entry {
  PyObject* param = nullptr;  // strong reference (held by `refs_`)
  PyTypeObject* type = nullptr;
  PyObject* pdict = nullptr;  // the param's __dict__ (main_grad lives there)
  DictSnapshot state;         // its state dict (stepped params only)
  int32_t bucket = -1;        // -1: no grad when cached (must still have none)
  int32_t pos = 0;            // index in its bucket
  int64_t version = 0;
  const void* data = nullptr;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kFloat, gdtype = at::kFloat;
};

class StepCache {
 public:
  StepCache(py::list group_lists, py::list params, py::list param_dicts, py::list state_dicts, py::object state,
            std::vector<int64_t> bucket_of, std::vector<int64_t> pos_of) {
    const size_t n = static_cast<size_t>(py::len(params));
    TORCH_CHECK(py::len(param_dicts) == n && py::len(state_dicts) == n && bucket_of.size() == n && pos_of.size() == n,
                "StepCache: per-param lists differ in length");
    for (auto l : group_lists) {
      TORCH_CHECK(PyList_Check(l.ptr()), "StepCache: group params must be lists");
      lists_.push_back(py::reinterpret_borrow<py::object>(l));
      lens_.push_back(PyList_GET_SIZE(l.ptr()));
    }
    TORCH_CHECK(PyDict_Check(state.ptr()), "StepCache: the optimizer state must be a dict");
    refs_.push_back(state);
    state_.take(state.ptr(), refs_);
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
      e.state.take(s.ptr(), refs_);
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

  // One bucket's kernel lists, read by name from `lists` (mpkern.optim.functional.KernelLists: the
  // tensor lists, stream_ids, elem_offsets, exp_avg_scales / exp_avg_sq_scales -- None without scales --
  // and moment_codec), stepped with `master_codec`.
  void add_bucket(const py::object& lists, std::string master_codec) {
    auto tensors = [&](const char* name) { return lists.attr(name).cast<std::vector<at::Tensor>>(); };
    Bucket b;
    b.params = tensors("params");
    b.grads.resize(b.params.size());
    b.exp_avgs = tensors("exp_avgs");
    b.exp_avg_sqs = tensors("exp_avg_sqs");
    b.max_exp_avg_sqs = tensors("max_exp_avg_sqs");
    b.masters = tensors("masters");
    b.steps = tensors("steps");
    b.scaled = !lists.attr("exp_avg_scales").is_none();
    if (b.scaled) {
      b.mscales = tensors("exp_avg_scales");
      b.vscales = tensors("exp_avg_sq_scales");
    }
    b.stream_ids = lists.attr("stream_ids").cast<std::vector<int64_t>>();
    b.elem_offsets = lists.attr("elem_offsets").cast<std::vector<int64_t>>();
    b.master_codec = std::move(master_codec);
    b.moment_codec = lists.attr("moment_codec").cast<std::string>();
    b.stats_offset = stats_.size();
    stats_.resize(stats_.size() + b.params.size());
    buckets_.push_back(std::move(b));
  }

  // True (grads gathered) if nothing the full path looks at has changed since the cache was built.
  bool refresh() {
    if (!state_.same()) return false;
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
        if (!e.state.same()) return fail();
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
    return grad_stats_handle().call(stats_, inv_scale);
  }

  // One mpkern::adamw_step_ call over bucket bi; true when it moved the version counter of the
  // bucket's first param (a kernel that bumps versions: the caller re-records the stamps).
  // The group's scalars -- beta1, beta2, eps, weight_decay, maximize, stochastic_rounding, seed -- come by
  // name in `scalars` (mpkern.optim.functional.GroupScalars as a dict).
  bool adamw(int64_t bi, const at::Tensor& grad_factor, const at::Tensor& found_inf,
             const std::optional<at::Tensor>& lr_tensor, double lr, const py::dict& scalars) {
    TORCH_CHECK(bi >= 0 && bi < static_cast<int64_t>(buckets_.size()), "StepCache: bad bucket ", bi);
    Bucket& b = buckets_[bi];
    AdamwArgs a;
    a.params = b.params;
    a.grads = b.grads;
    a.exp_avgs = b.exp_avgs;
    a.exp_avg_sqs = b.exp_avg_sqs;
    a.max_exp_avg_sqs = b.max_exp_avg_sqs;
    a.masters = b.masters;
    a.steps = b.steps;
    a.grad_factor = grad_factor;
    a.found_inf = found_inf;
    a.lr_tensor = lr_tensor;
    if (b.scaled) {
      a.exp_avg_scales = at::TensorList(b.mscales);
      a.exp_avg_sq_scales = at::TensorList(b.vscales);
    }
    a.lr = lr;
    a.beta1 = scalars["beta1"].cast<double>();
    a.beta2 = scalars["beta2"].cast<double>();
    a.eps = scalars["eps"].cast<double>();
    a.weight_decay = scalars["weight_decay"].cast<double>();
    a.maximize = scalars["maximize"].cast<bool>();
    a.master_codec = b.master_codec;
    a.moment_codec = b.moment_codec;
    a.stochastic_rounding = scalars["stochastic_rounding"].cast<bool>();
    a.seed = scalars["seed"].cast<int64_t>();
    a.stream_ids = b.stream_ids;
    a.elem_offsets = b.elem_offsets;
    const int64_t v0 = b.params.empty() ? 0 : b.params[0]._version();
    py::gil_scoped_release nogil;
    adamw_step_call(a);
    return !b.params.empty() && b.params[0]._version() != v0;
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

  c10::Device device_{c10::DeviceType::CPU};
  std::vector<py::object> lists_, refs_;
  std::vector<Py_ssize_t> lens_;
  py::object main_grad_;
  DictSnapshot state_;
  std::vector<Entry> entries_;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> stats_;
};

}  // namespace

void register_fastpath(py::module_& mod) {
  py::class_<StepCache>(mod, "StepCache", "Cached kernel argument lists of FusedAdamWMP.step (see csrc/fastpath.cpp)")
      .def(py::init<py::list, py::list, py::list, py::list, py::object, std::vector<int64_t>, std::vector<int64_t>>(),
           py::arg("group_lists"), py::arg("params"), py::arg("param_dicts"), py::arg("state_dicts"), py::arg("state"),
           py::arg("bucket_of"), py::arg("pos_of"))
      .def("add_bucket", &StepCache::add_bucket, py::arg("lists"), py::arg("master_codec"))
      .def("refresh", &StepCache::refresh)
      .def("grad_stats", &StepCache::grad_stats, py::arg("inv_scale"))
      .def("adamw", &StepCache::adamw, py::arg("bucket"), py::arg("grad_factor"), py::arg("found_inf"),
           py::arg("lr_tensor"), py::arg("lr"), py::arg("scalars"))
      .def("release", &StepCache::release)
      .def("grads", &StepCache::grads)
      .def_property_readonly("num_buckets", &StepCache::num_buckets);
}

}  // namespace mpkern
