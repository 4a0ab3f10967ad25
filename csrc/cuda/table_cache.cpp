// Device copies of the multi-tensor metadata tables of the CUDA kernels, cached by content.
//
// A table row holds only addresses, sizes, dtypes and chunk offsets, so two calls over the same
// tensors produce the same bytes, and a cached device copy with those bytes is exactly the table
// the call needs: no invalidation is ever required, and storage changes, new param groups or
// reallocated grads simply miss. Per call the host computes the bytes (a loop over the tensors,
// no allocation on the device, no copy) and looks them up. The rules (keys, pinning, eviction,
// what a hit or a miss does) are in table_lru.h, tested without a GPU.
//
// Streams: the host-to-device copy is ordered on the stream that built the table, and a kernel on
// another stream is not ordered after it. An event is recorded after the copy; a hit from another
// stream makes that stream wait on it (cudaStreamWaitEvent: no host sync) until the event has been
// seen complete, and records the buffer on that stream for the caching allocator (so freeing it on
// eviction waits for that stream's kernels).
//
// CUDA graphs: a table a capture uses is pinned (never evicted). A hit inside a capture neither
// waits nor records (an event recorded outside the capture cannot be waited on there);
// torch.cuda.graph synchronises the device before it captures, so a table built in the warm-up
// step has landed by then. A capture that misses -- PyTorch's whole-network recipe,
// `zero_grad(set_to_none=True)` then forward, backward and step() inside `torch.cuda.graph`,
// allocates the grads in the graph's pool, so their tables are new -- builds the table beside the
// capture (build_beside_capture): a buffer from the caching allocator's ordinary pool, filled by a
// copy on a side stream of the cache's and waited for on the host, all before the capture goes
// on. The graph holds no copy of its own: every replay, and every later eager call with the same
// tensors, reads the table as it is, and it is pinned like any captured table. The host waits
// only there, at capture time.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string_view>
#include <tuple>
#include <unordered_map>

#include "table_lru.h"

namespace mpkern {
namespace cuda {

namespace {

constexpr size_t kMaxTables = 256;  // not counting the tables CUDA graphs use

struct Table {
  at::Tensor buffer;                            // uint8 on the device
  c10::cuda::CUDAStream stream;                 // where it was allocated and copied
  std::shared_ptr<at::cuda::CUDAEvent> copied;  // recorded on `stream` after the copy (eager builds)
  bool landed;                                  // the copy was seen complete: no stream needs to wait any more
};

struct Cache {
  std::mutex mu;
  TableLru<Table> tables{kMaxTables};
  std::unordered_map<int, cudaStream_t> side;  // per device: the stream of builds beside a capture
  int64_t builds = 0, hits = 0;

  // A non-blocking stream of the cache's own (never one of torch's pool streams, one of which
  // may be the capturing stream), created once per device; the caller holds `mu` and has the
  // thread in relaxed capture mode.
  c10::cuda::CUDAStream side_stream(int dev) {
    auto it = side.find(dev);
    if (it == side.end()) {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
      cudaStream_t s = nullptr;
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      it = side.emplace(dev, s).first;
    }
    return c10::cuda::getStreamFromExternal(it->second, static_cast<c10::DeviceIndex>(dev));
  }
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: device memory outlives static destructors
  return *c;
}

// Eager: an asynchronous copy from a pinned staging buffer on the current stream, and an event.
Table build_on_stream(c10::Device device, const c10::cuda::CUDAStream& stream, const void* bytes, size_t nbytes) {
  at::Tensor pinned =
      at::empty({static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(pinned.data_ptr(), bytes, nbytes);
  at::Tensor buffer = at::empty({static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte).device(device));
  buffer.copy_(pinned, /*non_blocking=*/true);
  auto copied = std::make_shared<at::cuda::CUDAEvent>();
  copied->record(stream);
  return Table{buffer, stream, std::move(copied), false};
}

// During a capture (see the top of the file). The thread is switched to relaxed capture mode for
// it, as the caching allocator does around cudaMalloc during a capture: in the default (global)
// mode a stream synchronisation while any stream captures is an error, even of a stream that is
// not capturing. The side stream is non-blocking and not capturing, so nothing here joins the
// graph; the buffer is allocated on it, which puts it in the allocator's ordinary pool (the
// graph's pool serves the capturing stream only). No pinned buffer is needed: the host waits.
Table build_beside_capture(Cache& c, c10::Device device, const void* bytes, size_t nbytes) {
  c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
  const c10::cuda::CUDAStream side = c.side_stream(device.index());
  at::Tensor buffer;
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    buffer = at::empty({static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte).device(device));
  }
  C10_CUDA_CHECK(cudaMemcpyAsync(buffer.data_ptr(), bytes, nbytes, cudaMemcpyHostToDevice, side.stream()));
  C10_CUDA_CHECK(cudaStreamSynchronize(side.stream()));
  return Table{buffer, side, nullptr, true};
}

// A hit: order the current stream after the table's copy (table_lru.h on_hit).
void order_after_copy(Table& t, const c10::cuda::CUDAStream& stream, bool capturing) {
  switch (on_hit(capturing, t.stream == stream, t.landed)) {
    case HitAction::kNone: return;
    case HitAction::kQueryThenWait:
      if (t.copied->query()) {
        t.landed = true;
      } else {
        t.copied->block(stream);  // the copy on the building stream first
      }
      break;
    case HitAction::kRecordStream: break;
  }
  t.buffer.record_stream(stream);
}
}  // namespace

const void* cached_table(c10::Device device, const void* bytes, size_t nbytes) {
  const std::string_view key(static_cast<const char*>(bytes), nbytes);
  const int dev = device.index();
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(dev);
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  if (auto* e = c.tables.find(dev, key, capturing)) {
    order_after_copy(e->payload, stream, capturing);
    ++c.hits;
    return e->payload.buffer.data_ptr();
  }
  Table t = on_miss(capturing) == MissAction::kBuildBesideCapture ? build_beside_capture(c, device, bytes, nbytes)
                                                                  : build_on_stream(device, stream, bytes, nbytes);
  ++c.builds;
  return c.tables.insert(dev, key, std::move(t), capturing).payload.buffer.data_ptr();
}

std::tuple<int64_t, int64_t, int64_t> table_cache_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return {c.builds, c.hits, static_cast<int64_t>(c.tables.size())};
}

void table_cache_clear() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.tables.clear_unpinned();
}

}  // namespace cuda
}  // namespace mpkern
