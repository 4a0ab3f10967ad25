// Device copies of the multi-tensor metadata tables of the CUDA kernels, cached by content.
//
// A table row holds only addresses, sizes, dtypes and chunk offsets, so two calls over the same
// tensors produce the same bytes, and a cached device copy with those bytes is exactly the table
// the call needs: no invalidation is ever required, and storage changes, new param groups or
// reallocated grads simply miss. Per call the host computes the bytes (a loop over the tensors,
// no allocation on the device, no copy) and looks them up.
//
// Streams: the host-to-device copy is ordered on the stream that built the table, and a kernel on
// another stream is not ordered after it. An event is recorded after the copy; a hit from another
// stream makes that stream wait on it (cudaStreamWaitEvent: no host sync) until the event has been
// seen complete, and records the buffer on that stream for the caching allocator (so freeing it on
// eviction waits for that stream's kernels). Inside a capture neither is possible (an event recorded
// outside the capture cannot be queried or waited on there); torch.cuda.graph synchronises the
// device before it captures, so a table built in the warm-up step has landed by then.
//
// CUDA graphs: a lookup during a capture must hit (building means a host-to-device copy from
// a temporary pinned buffer, which a replay would repeat from freed memory); a miss raises an
// error that says to run an eager step first. Tables used inside a capture are never evicted.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>

namespace mpkern {
namespace cuda {

namespace {

constexpr size_t kMaxTables = 256;  // not counting the tables CUDA graphs use

struct Entry {
  int device;
  std::string bytes;
  at::Tensor buffer;  // uint8 on the device
  c10::cuda::CUDAStream stream;  // where it was allocated and copied
  std::shared_ptr<at::cuda::CUDAEvent> copied;  // recorded on `stream` after the copy
  bool captured = false;  // used by a captured graph: kept for the life of the process
  bool landed = false;    // `copied` was seen complete: no stream needs to wait any more
};

struct Cache {
  std::mutex mu;
  std::list<Entry> lru;  // most recently used first
  std::unordered_multimap<size_t, std::list<Entry>::iterator> index;
  int64_t builds = 0, hits = 0;

  size_t key_hash(int device, std::string_view bytes) const {
    return std::hash<std::string_view>()(bytes) ^ (static_cast<size_t>(device) * 0x9e3779b97f4a7c15ull);
  }

  // Drop one entry; returns the next one.
  std::list<Entry>::iterator erase(std::list<Entry>::iterator it) {
    auto range = index.equal_range(key_hash(it->device, it->bytes));
    for (auto j = range.first; j != range.second; ++j) {
      if (j->second == it) {
        index.erase(j);
        break;
      }
    }
    return lru.erase(it);
  }

  // Keep at most kMaxTables entries that no graph uses, dropping the least recently used.
  void evict() {
    size_t uncaptured = 0;
    for (const Entry& e : lru) uncaptured += !e.captured;
    for (auto it = lru.end(); uncaptured > kMaxTables && it != lru.begin();) {
      --it;
      if (it->captured) continue;
      it = erase(it);
      --uncaptured;
    }
  }
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: device memory outlives static destructors
  return *c;
}
}  // namespace

const void* cached_table(c10::Device device, const void* bytes, size_t nbytes) {
  const std::string_view key(static_cast<const char*>(bytes), nbytes);
  const int dev = device.index();
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(dev);
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  const size_t h = c.key_hash(dev, key);
  auto range = c.index.equal_range(h);
  for (auto j = range.first; j != range.second; ++j) {
    auto it = j->second;
    if (it->device != dev || it->bytes != key) continue;
    c.lru.splice(c.lru.begin(), c.lru, it);  // most recently used
    it->captured = it->captured || capturing;
    if (!capturing && it->stream != stream) {
      if (!it->landed) {
        if (it->copied->query()) {
          it->landed = true;
        } else {
          it->copied->block(stream);  // the copy on the building stream first
        }
      }
      it->buffer.record_stream(stream);
    }
    ++c.hits;
    return it->buffer.data_ptr();
  }
  TORCH_CHECK(!capturing,
              "mpkern: cannot capture this call in a CUDA graph: its tensor list (addresses, sizes or dtypes) has "
              "no device metadata table yet, and building one needs a host-to-device copy. Run the same call once "
              "eagerly before capturing (a warm-up step), and keep the params, grads and optimizer state in the "
              "same storage between warm-up and capture.");
  at::Tensor pinned =
      at::empty({static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(pinned.data_ptr(), bytes, nbytes);
  at::Tensor buffer = at::empty({static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte).device(device));
  buffer.copy_(pinned, /*non_blocking=*/true);
  auto copied = std::make_shared<at::cuda::CUDAEvent>();
  copied->record(stream);
  c.lru.push_front(Entry{dev, std::string(key), buffer, stream, std::move(copied)});
  c.index.emplace(h, c.lru.begin());
  ++c.builds;
  c.evict();
  return buffer.data_ptr();
}

std::tuple<int64_t, int64_t, int64_t> table_cache_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return {c.builds, c.hits, static_cast<int64_t>(c.lru.size())};
}

void table_cache_clear() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto it = c.lru.begin(); it != c.lru.end();) it = it->captured ? std::next(it) : c.erase(it);
}

}  // namespace cuda
}  // namespace mpkern
