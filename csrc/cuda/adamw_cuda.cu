// CUDA kernel of mpkern::adamw_step_ (contract in csrc/cpu/adamw_cpu.cpp).
//
// The kernel is specialised at compile time on (param dtype, grad dtype, moment dtype, master
// mode): one launch per dtype combination present in the list (usually one), never one per
// tensor. Each thread updates 8 elements at a time with 16-byte loads and stores (two for fp32
// buffers); a tensor whose buffers are not all 16-byte aligned at a common element gets scalar
// head and tail elements around the vector body, or the scalar loop when no common alignment
// exists; the read-only grad may sit at any offset (aligned blocks and shifts). A one-block launch
// first computes each tensor's constants for the step (fp64, once per tensor), then bumps the step
// counters; both launches read found_inf on the device and do nothing when it is set: no host sync.
// The metadata table is cached on the device (multi_tensor.cuh): a step can be captured in a CUDA
// graph. 8-bit moments (math.h mom8_*) and the 4-bit exp_avg (mom4_*): 8 consecutive elements per
// lane, wide loads, four lanes per 32-group (its amax in two shuffles); unaligned tensors and a
// tensor's last pass use per-element loads (adam_mom_chunk).
//
// One translation unit in four files: this one (the kernels' entry points, the launch shapes, the host
// code), adamw_lanes.cuh (per-lane building blocks), adamw_dense.cuh and adamw_compact.cuh (the two
// kinds of element update).
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../adamw_common.h"
#include "../kernels.h"
#include "adamw_compact.cuh"
#include "adamw_dense.cuh"
#include "adamw_lanes.cuh"
#include "multi_tensor.cuh"

namespace mpkern {
namespace cuda {

namespace {

// The launch shape of the update kernel, chosen per GPU arch (kArchConfigs) or set for a sweep
// (set_adamw_config): threads per block (a multiple of 32, at most kAdamBlock, the launch bound the
// kernels are compiled for), grid blocks per SM (the grid is min(chunks, SMs x grid_per_sm) blocks
// striding over the chunks), elements per chunk (a multiple of kMomSpan, at most kChunk), and the
// compact kernels' load stages (1: a warp pass's loads in registers; 2: the next pass's loads copied
// into shared memory while the current one updates, mom_wide_passes_staged). Every shape gives the
// same results bit for bit: the arithmetic and the random bits are per element.
struct AdamConfig {
  int block, grid_per_sm;
  int64_t chunk;
  int stages;
};
// The measured best shape per arch (major, minor; minor -1: any of that major), with the run that
// measured it: `python -m tools.gpu_check.sweep` (the sweep_adamw stage of gpu_check.sh --profile scale)
// prints the row to put here. The last row, arch 0, is the default of every other arch.
struct ArchConfig {
  int major, minor;
  AdamConfig config;
  const char* source;
};
constexpr ArchConfig kArchConfigs[] = {
    {0, -1, {kAdamBlock, 8, kChunk, 1}, "built-in default: no sweep of this arch recorded yet"},
};

// Blocks per SM asked of ptxas (0: its own choice, which targets 64 registers = 4 blocks of 256 for
// every instance). The no-master fp32-moment instances spill 4 bytes at 64 registers on sm_90: they
// may use up to 80 (3 blocks of 256 per SM), spill-free. The compact-moment instances (8 elements
// per lane) take 100-112 registers spill-free and spill at 80: 2 blocks (512 threads, each with
// ~60 bytes of loads in flight: ~30 KB per SM).
constexpr int adam_min_blocks(int moment_mode, int master_mode) {
  return moment_grouped(moment_mode) ? 2 : (moment_mode == kF32 && master_mode == kMasterNone ? 3 : 0);
}

template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE>
__global__ void __launch_bounds__(kAdamBlock, adam_min_blocks(MOMENT_MODE, MASTER_MODE))
    adamw_kernel(const AdamMeta* __restrict__ meta, const TensorConsts* __restrict__ consts, int count,
                 int64_t total_chunks, AdamScalars s) {
  if (*s.found_inf != 0.f) return;
  // maximize: -(g * factor) == g * (-factor) exactly (sign flips commute with rounding)
  const float factor = s.maximize ? -*s.factor : *s.factor;
  for (int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    // every thread finds the chunk's tensor (the same loads across the block: broadcasts, no barrier)
    const int ti = find_tensor(meta, count, c);
    const AdamMeta t = meta[ti];
    const AdamWConsts cs = consts[ti].c;
    const int64_t begin = (c - t.chunk_begin) * s.chunk;
    const int64_t end = min(t.numel, begin + s.chunk);
    // random keys for this chunk's elements (math.h, rng_keys): a few multiplies per thread and chunk
    RngKeys keys{};
    if (MOMENT_MODE == kBF16 || moment_grouped(MOMENT_MODE) || needs_word0<PDT, MOMENT_MODE, MASTER_MODE>(s.sr))
      keys =
          rng_keys(s.seed, t.stream, consts[ti].step, static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(begin));
    if constexpr (moment_grouped(MOMENT_MODE)) {
      const ChunkKeys ck = chunk_keys(keys, static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(end - 1));
      adam_mom_chunk<PDT, GDT, MOMENT_MODE, MASTER_MODE>(t, begin, end, cs, factor, s.sr, ck, s.stages);
      continue;
    }
    // vector body [vb, ve): starts at the tensor's common aligned element (chunks are multiples of kVE)
    const int64_t vb = t.head < 0 ? end : min(end, begin + t.head);
    const int64_t ve = vb + (end - vb) / kVE * kVE;
    for (int64_t i = begin + threadIdx.x; i < vb; i += blockDim.x)
      adam_scalar<PDT, GDT, MOMENT_MODE, MASTER_MODE>(t, i, cs, factor, s.sr, keys);
    for (int64_t i = vb + threadIdx.x * kVE; i < ve; i += blockDim.x * kVE)
      adam_vec<PDT, GDT, MOMENT_MODE, MASTER_MODE>(t, i, cs, factor, s.sr, keys);
    for (int64_t i = ve + threadIdx.x; i < end; i += blockDim.x)
      adam_scalar<PDT, GDT, MOMENT_MODE, MASTER_MODE>(t, i, cs, factor, s.sr, keys);
  }
}

// One block before the update: every tensor's constants for this step from its step count (fp64,
// once per tensor instead of once per chunk), then -- after all counts are read, so a counter shared
// by two rows is read before either increment, as before -- the counters' increment.
constexpr int kPrepBlock = 512;
__global__ void __launch_bounds__(kPrepBlock)
    prep_kernel(const AdamMeta* __restrict__ meta, int count, AdamScalars s, TensorConsts* __restrict__ out) {
  if (*s.found_inf != 0.f) return;
  const double lr = s.lr_ptr ? static_cast<double>(*s.lr_ptr) : s.lr;
  for (int t = threadIdx.x; t < count; t += blockDim.x) {
    const double step = static_cast<double>(*reinterpret_cast<const float*>(meta[t].step)) + 1.0;
    out[t].c = adamw_consts(lr, s.beta1, s.beta2, s.eps, s.weight_decay, step);
    out[t].step = static_cast<uint32_t>(step);
  }
  __syncthreads();
  for (int t = threadIdx.x; t < count; t += blockDim.x) *reinterpret_cast<float*>(meta[t].step) += 1.f;
}

using AdamKernel = void (*)(const AdamMeta*, const TensorConsts*, int, int64_t, AdamScalars);

// The dynamic shared memory of a two-stage compact launch: its instance's MomStage (by param dtype and
// master mode; 28-37 KB, under the 48 KB a launch may ask without opting in).
template <int MASTER_MODE>
size_t mom_stage_bytes_m(int32_t pdt) {
  switch (pdt) {
    case kF32: return sizeof(MomStage<kF32, MASTER_MODE>);
    case kF16: return sizeof(MomStage<kF16, MASTER_MODE>);
    default: return sizeof(MomStage<kBF16, MASTER_MODE>);
  }
}
size_t mom_stage_bytes(int32_t pdt, int64_t master_mode) {
  switch (master_mode) {
    case kMasterF32: return mom_stage_bytes_m<kMasterF32>(pdt);
    case kMasterRemainder: return mom_stage_bytes_m<kMasterRemainder>(pdt);
    case kMaster8bit: return mom_stage_bytes_m<kMaster8bit>(pdt);
    default: return mom_stage_bytes_m<kMasterNone>(pdt);
  }
}
static_assert(sizeof(MomStage<kF32, kMasterF32>) <= 48 * 1024 && sizeof(MomStage<kBF16, kMaster8bit>) <= 48 * 1024,
              "a two-stage launch asks at most 48 KB of dynamic shared memory (no opt-in attribute)");

template <int PDT, int GDT, int MASTER_MODE>
AdamKernel pick_s(int32_t moment_mode) {
  if (moment_mode == kMom8) return &adamw_kernel<PDT, GDT, kMom8, MASTER_MODE>;
  if (moment_mode == kMom4) return &adamw_kernel<PDT, GDT, kMom4, MASTER_MODE>;
  return moment_mode == kF32 ? &adamw_kernel<PDT, GDT, kF32, MASTER_MODE> : &adamw_kernel<PDT, GDT, kBF16, MASTER_MODE>;
}
template <int PDT, int MASTER_MODE>
AdamKernel pick_g(int32_t gdt, int32_t moment_mode) {
  switch (gdt) {
    case kF32: return pick_s<PDT, kF32, MASTER_MODE>(moment_mode);
    case kF16: return pick_s<PDT, kF16, MASTER_MODE>(moment_mode);
    default: return pick_s<PDT, kBF16, MASTER_MODE>(moment_mode);
  }
}
template <int MASTER_MODE>
AdamKernel pick_p(int32_t pdt, int32_t gdt, int32_t moment_mode) {
  switch (pdt) {
    case kF32: return pick_g<kF32, MASTER_MODE>(gdt, moment_mode);
    case kF16: return pick_g<kF16, MASTER_MODE>(gdt, moment_mode);
    default: return pick_g<kBF16, MASTER_MODE>(gdt, moment_mode);
  }
}
AdamKernel pick(int32_t pdt, int32_t gdt, int32_t moment_mode, int64_t master_mode) {
  if (master_mode == kMasterRemainder)
    return pick_g<kBF16, kMasterRemainder>(gdt, moment_mode);  // bf16 params (checked)
  if (master_mode == kMaster8bit)                              // bf16 or fp16 params (checked)
    return pdt == kF16 ? pick_g<kF16, kMaster8bit>(gdt, moment_mode) : pick_g<kBF16, kMaster8bit>(gdt, moment_mode);
  return master_mode == kMasterF32 ? pick_p<kMasterF32>(pdt, gdt, moment_mode)
                                   : pick_p<kMasterNone>(pdt, gdt, moment_mode);
}

int64_t addr(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

// Smallest h in [0, kVE) such that element h of every buffer (address, element size) is 16-byte
// aligned; -1 if there is none.
int32_t common_head(const int64_t (&ptrs)[6], const int (&sizes)[6]) {
  for (int h = 0; h < kVE; ++h) {
    bool ok = true;
    for (int k = 0; k < 6; ++k) ok = ok && (ptrs[k] == 0 || ((ptrs[k] + h * sizes[k]) & 15) == 0);
    if (ok) return h;
  }
  return -1;
}

int esize(const at::Tensor& t) { return static_cast<int>(t.element_size()); }
// Compact moments: 0 when element 0 of every buffer is aligned for the lanes' 8-element accesses
// (16 bytes for 16/32-bit buffers, 8 for 8-bit codes and corrections, 4 for 4-bit codes), else -1.
int32_t compact_head(const int64_t (&ptrs)[6], const int (&sizes)[6], bool mom4) {
  const int64_t need[6] = {16, 1, mom4 ? 4 : 8, 8, 16, sizes[5] == 1 ? 8 : 16};  // grad: load8_shifted
  for (int k = 0; k < 6; ++k)
    if (ptrs[k] % need[k] != 0) return -1;
  return 0;
}

// The shape set for a sweep (set_adamw_config), if any; else the device's row of kArchConfigs, looked up
// once per device. No allocation: this runs on every step.
struct ConfigChoice {
  AdamConfig config;
  const char* source;  // the row's, or "set_adamw_config"
};
std::mutex g_config_mutex;
std::optional<AdamConfig> g_config_override;
ConfigChoice config_for(int device_index) {
  static const ArchConfig* per_device[64] = {};
  const std::lock_guard<std::mutex> lock(g_config_mutex);
  if (g_config_override.has_value()) return {*g_config_override, "set_adamw_config"};
  TORCH_CHECK(device_index >= 0 && device_index < 64, "mpkern: CUDA device index ", device_index, " out of range");
  const ArchConfig*& row = per_device[device_index];
  if (row == nullptr) {
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device_index);
    // this arch's row, else its major's (minor -1), else the default (the last row)
    row = &kArchConfigs[sizeof(kArchConfigs) / sizeof(kArchConfigs[0]) - 1];
    for (const ArchConfig& a : kArchConfigs)
      if (a.major == prop->major && a.minor < 0) row = &a;
    for (const ArchConfig& a : kArchConfigs)
      if (a.major == prop->major && a.minor == prop->minor) row = &a;
  }
  return {row->config, row->source};
}

}  // namespace

std::tuple<int64_t, int64_t, int64_t, int64_t, std::string> adamw_config(int64_t device_index) {
  const ConfigChoice c = config_for(static_cast<int>(device_index));
  return {c.config.block, c.config.grid_per_sm, c.config.chunk, c.config.stages, std::string(c.source)};
}

void set_adamw_config(int64_t block, int64_t grid_per_sm, int64_t chunk, int64_t stages) {
  TORCH_CHECK_VALUE(block >= 32 && block <= kAdamBlock && block % 32 == 0,
                    "set_adamw_config: block must be a "
                    "multiple of 32 in [32, ",
                    kAdamBlock, "] (the kernels' launch bound), got ", block);
  TORCH_CHECK_VALUE(grid_per_sm >= 1 && grid_per_sm <= 64, "set_adamw_config: grid_per_sm must be in [1, 64], got ",
                    grid_per_sm);
  TORCH_CHECK_VALUE(chunk >= kMomSpan && chunk <= kChunk && chunk % kMomSpan == 0,
                    "set_adamw_config: chunk must be a "
                    "multiple of ",
                    kMomSpan, " in [", kMomSpan, ", ", kChunk, "], got ", chunk);
  TORCH_CHECK_VALUE(stages == 1 || stages == 2, "set_adamw_config: stages must be 1 or 2, got ", stages);
  const std::lock_guard<std::mutex> lock(g_config_mutex);
  g_config_override =
      AdamConfig{static_cast<int>(block), static_cast<int>(grid_per_sm), chunk, static_cast<int>(stages)};
}

void clear_adamw_config() {
  const std::lock_guard<std::mutex> lock(g_config_mutex);
  g_config_override.reset();
}

void adamw_step_cuda_(const AdamwArgs& args, int64_t master_mode, int64_t moment_mode) {
  const at::TensorList params = args.params, grads = args.grads, exp_avgs = args.exp_avgs;
  const at::TensorList exp_avg_sqs = args.exp_avg_sqs, max_exp_avg_sqs = args.max_exp_avg_sqs;
  const at::TensorList masters = args.masters, steps = args.steps;
  const at::TensorList exp_avg_scales = list_or_empty(args.exp_avg_scales);
  const at::TensorList exp_avg_sq_scales = list_or_empty(args.exp_avg_sq_scales);
  // arguments checked by the registered op (csrc/ops.cpp, adamw_step_op)
  if (params.empty()) return;
  const c10::Device dev = params[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  // the moment modes this kernel has variants for (pick_s): anything else is refused before any launch
  TORCH_CHECK_NOT_IMPLEMENTED(
      moment_mode == kMomF32 || moment_mode == kMomBF16 || moment_mode == kMom8 || moment_mode == kMom4,
      "mpkern::adamw_step_: the CUDA kernel has no variant for moment mode ", moment_mode);
  const AdamConfig cfg = config_for(dev.index()).config;
  const int32_t mm = static_cast<int32_t>(moment_mode);
  const bool grouped = moment_grouped(mm);
  const size_t n = params.size();
  // Rows grouped by dtype combination (one launch each), in list order inside a group. Every
  // tensor has a row (empty ones too: their step counters still advance); only non-empty ones
  // own chunks.
  struct Launch {
    int32_t pdt, gdt;
    int first = 0, count = 0;
    int64_t chunks = 0;
  };
  std::vector<Launch> launches;
  std::vector<int> launch_of(n);
  for (size_t i = 0; i < n; ++i) {
    const int32_t pdt = dtype_code(params[i].scalar_type()), gdt = dtype_code(grads[i].scalar_type());
    size_t l = 0;
    while (l < launches.size() && !(launches[l].pdt == pdt && launches[l].gdt == gdt)) ++l;
    if (l == launches.size()) launches.push_back({pdt, gdt});
    launch_of[i] = static_cast<int>(l);
    launches[l].count++;
  }
  for (size_t l = 1; l < launches.size(); ++l) launches[l].first = launches[l - 1].first + launches[l - 1].count;
  std::vector<AdamMeta> rows(n);
  std::vector<int> filled(launches.size(), 0);
  for (size_t i = 0; i < n; ++i) {
    Launch& L = launches[launch_of[i]];
    AdamMeta& a = rows[L.first + filled[launch_of[i]]++];
    a.p = addr(params[i]);
    a.g = addr(grads[i]);
    a.m = addr(exp_avgs[i]);
    a.v = addr(exp_avg_sqs[i]);
    a.vmax = max_exp_avg_sqs.empty() ? 0 : addr(max_exp_avg_sqs[i]);
    a.master = masters.empty() ? 0 : addr(masters[i]);
    a.step = addr(steps[i]);
    a.sm = exp_avg_scales.empty() ? 0 : addr(exp_avg_scales[i]);
    a.sv = exp_avg_sq_scales.empty() ? 0 : addr(exp_avg_sq_scales[i]);
    a.numel = params[i].numel();
    a.chunk_begin = L.chunks;
    const int64_t ptrs[6] = {a.p, 0, a.m, a.v, a.vmax, a.master};  // any grad offset: load8_shifted
    const int sizes[6] = {esize(params[i]),
                          esize(grads[i]),
                          esize(exp_avgs[i]),
                          esize(exp_avg_sqs[i]),
                          4,
                          masters.empty() ? 4 : esize(masters[i])};
    a.head = grouped ? compact_head(ptrs, sizes, moment_codes_per_byte(mm) == 2) : common_head(ptrs, sizes);
    a.offset = static_cast<int64_t>(offset_of(args.elem_offsets, i));
    a.stream = stream_of(args.stream_ids, i);
    L.chunks += (a.numel + cfg.chunk - 1) / cfg.chunk;
  }
  const AdamMeta* meta = cached_rows(dev, rows);
  AdamScalars s;
  s.lr = args.lr;
  s.lr_ptr = args.lr_tensor.has_value() ? args.lr_tensor->data_ptr<float>() : nullptr;
  s.factor = args.grad_factor.data_ptr<float>();
  s.found_inf = args.found_inf.data_ptr<float>();
  s.beta1 = args.beta1;
  s.beta2 = args.beta2;
  s.eps = args.eps;
  s.weight_decay = args.weight_decay;
  s.maximize = args.maximize;
  s.sr = args.stochastic_rounding;
  s.seed = static_cast<uint32_t>(args.seed);
  s.chunk = cfg.chunk;
  s.stages = cfg.stages;
  auto stream = at::cuda::getCurrentCUDAStream();
  // the step's per-tensor constants: a stream-ordered scratch buffer (from the graph pool under capture)
  const int count = static_cast<int>(n);
  at::Tensor scratch =
      at::empty({static_cast<int64_t>(n * sizeof(TensorConsts))}, params[0].options().dtype(at::kByte));
  auto* consts = reinterpret_cast<TensorConsts*>(scratch.data_ptr());
  prep_kernel<<<1, kPrepBlock, 0, stream>>>(meta, count, s, consts);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  for (const Launch& L : launches) {
    if (L.chunks == 0) continue;
    // two stages: the compact kernels' slots (only a 16-bit grad's kernel stages its loads)
    const size_t smem = cfg.stages == 2 && grouped && L.gdt != kF32 ? mom_stage_bytes(L.pdt, master_mode) : 0;
    pick(L.pdt, L.gdt, mm, master_mode)<<<grid_for(L.chunks, cfg.grid_per_sm), cfg.block, smem, stream>>>(
        meta + L.first, consts + L.first, L.count, L.chunks, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace mpkern

// registered by csrc/ops.cpp (the schema's codecs parsed there; see csrc/kernels.h)
