// CPU AdamW, the scalar path: the shared math (csrc/include/mpkern/math.h) element by element --
// every mode, MPKERN_CPU_SIMD=0, and the vector paths' tails and partial groups.
#include <cstdint>

#include "../kernels.h"
#include "adamw_cpu_impl.h"

namespace mpkern {
namespace cpu {
namespace adamw_impl {

namespace {

// The fp32 master value of element i (the param itself in kMasterNone).
inline float load_w(const TensorPtrs& t, const Flags& f, int64_t i) {
  if (f.master_mode == kMasterF32) return static_cast<const float*>(t.master)[i];
  if (f.master_mode == kMasterRemainder)
    return join_master(static_cast<const uint16_t*>(t.p)[i], static_cast<const int16_t*>(t.master)[i]);
  if (f.master_mode == kMaster8bit)
    return master8_decode(static_cast<const uint16_t*>(t.p)[i], static_cast<const int8_t*>(t.master)[i], t.pdt);
  return load_as_f32(t.p, i, t.pdt);
}

// Store the updated master p of element i (and the param); r0 = the element's random word when needed.
inline void store_w(const TensorPtrs& t, const Flags& f, int64_t i, float p, uint32_t r0, bool w0) {
  if (f.master_mode == kMasterF32) {
    static_cast<float*>(t.master)[i] = p;
    store_from_f32(t.p, i, t.pdt, p);
  } else if (f.master_mode == kMasterRemainder) {
    uint16_t hi;
    int16_t rem;
    split_master(p, hi, rem);
    static_cast<uint16_t*>(t.p)[i] = hi;
    static_cast<int16_t*>(t.master)[i] = rem;
  } else if (f.master_mode == kMaster8bit) {
    uint16_t h;
    int8_t c;
    master8_encode(p, t.pdt, r0, h, c);
    static_cast<uint16_t*>(t.p)[i] = h;
    static_cast<int8_t*>(t.master)[i] = c;
  } else if (w0) {
    static_cast<uint16_t*>(t.p)[i] = f32_to_bf16_sr(p, rand_a16(r0));
  } else {
    store_from_f32(t.p, i, t.pdt, p);
  }
}

}  // namespace

bool cpu_has_moment_mode(int32_t moment_mode) {
  return moment_mode == kMomF32 || moment_mode == kMomBF16 || moment_mode == kMom8 || moment_mode == kMom4;
}

void adamw_scalar(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f) {
  const bool w0 = needs_word0(t, f), w1 = t.moment_mode == kMomBF16, w = needs_word(t, f);
  const RngKeys keys = rng_keys(f.seed, t.stream, t.step, t.offset + static_cast<uint64_t>(begin));
  for (int64_t i = begin; i < end; ++i) {
    const uint64_t e = t.offset + static_cast<uint64_t>(i);
    const uint32_t r = w ? rng_word(keys, e) : 0u;
    float g = load_as_f32(t.g, i, t.gdt) * f.factor;
    if (f.maximize) g = -g;
    float p = load_w(t, f, i);
    float m = load_as_f32(t.m, i, t.moment_mode);
    float v = load_as_f32(t.v, i, t.moment_mode);
    p = adamw_update(p, g, m, v, t.vmax ? t.vmax + i : nullptr, t.c);
    if (w1) {
      static_cast<uint16_t*>(t.m)[i] = f32_to_bf16_sr(m, rand_b16(r));
      static_cast<uint16_t*>(t.v)[i] = f32_to_bf16_sr(v, rand_c16(r));
    } else {
      static_cast<float*>(t.m)[i] = m;
      static_cast<float*>(t.v)[i] = v;
    }
    store_w(t, f, i, p, r, w0);
  }
}

// 8-bit moments (and the 4-bit exp_avg of kMom4), group by group (begin a multiple of 32; the last
// group may be partial): decode, update and store master/param per element, then the group's scales
// and the codes (math.h mom8_*, mom4_*).
void adamw_scalar_grouped(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f) {
  const bool w0 = needs_word0(t, f);
  const bool m4 = t.moment_mode == kMom4;
  const RngKeys keys = rng_keys(f.seed, t.stream, t.step, t.offset + static_cast<uint64_t>(begin));
  uint8_t* cm = static_cast<uint8_t*>(t.m);
  uint8_t* cm4 = static_cast<uint8_t*>(t.m);
  uint8_t* cv = static_cast<uint8_t*>(t.v);
  for (int64_t gb = begin; gb < end; gb += kMom8Group) {
    const int cnt = static_cast<int>(end - gb < kMom8Group ? end - gb : kMom8Group);
    const int64_t j = gb / kMom8Group;
    const float sm = bf16_to_f32(t.sm[j]), sv = bf16_to_f32(t.sv[j]);
    float m[kMom8Group], v[kMom8Group];
    uint32_t r[kMom8Group];
    uint32_t am = 0u, av = 0u;
    for (int k = 0; k < cnt; ++k) {
      const int64_t i = gb + k;
      const uint64_t e = t.offset + static_cast<uint64_t>(i);
      r[k] = rng_word(keys, e);
      float g = load_as_f32(t.g, i, t.gdt) * f.factor;
      if (f.maximize) g = -g;
      float p = load_w(t, f, i);
      float mm = m4 ? mom4_decode_m(mom4_code(cm4[i >> 1], i), sm) : mom8_decode_m(cm[i], sm);
      float vv = mom8_decode_v(cv[i], sv);
      p = adamw_update(p, g, mm, vv, nullptr, t.c);
      store_w(t, f, i, p, r[k], w0);
      m[k] = mm;
      v[k] = vv;
      const uint32_t a = f32_bits(mm) & 0x7fffffffu, b = f32_bits(vv) & 0x7fffffffu;
      am = a > am ? a : am;
      av = b > av ? b : av;
    }
    const uint32_t bm = ladder_scale_bits(am, m4 ? ladder_m4() : ladder_m8()), bv = ladder_scale_bits(av, ladder_v8());
    const float im = ladder_inv_scale(bm), iv = ladder_inv_scale(bv);
    const bool okm = bm != kMom8NaNScale, okv = bv != kMom8NaNScale;  // a NaN group's codes are 0
    for (int k = 0; k < cnt; ++k) cv[gb + k] = okv ? mom8_encode_v(v[k], iv, rand_c16(r[k])) : 0;
    if (m4) {
      for (int k = 0; k < cnt; k += 2) {  // gb is even: a byte's two codes are k, k + 1 of this group
        const uint32_t c0 = mom4_encode_m(m[k], im, rand_b16(r[k]));
        const uint32_t c1 = k + 1 < cnt ? mom4_encode_m(m[k + 1], im, rand_b16(r[k + 1])) : 0u;
        cm4[(gb + k) >> 1] = okm ? mom4_pack(c0, c1) : 0;
      }
    } else {
      for (int k = 0; k < cnt; ++k) cm[gb + k] = okm ? mom8_encode_m(m[k], im, rand_b16(r[k])) : 0;
    }
    t.sm[j] = static_cast<uint16_t>(bm);
    t.sv[j] = static_cast<uint16_t>(bv);
  }
}

}  // namespace adamw_impl
}  // namespace cpu
}  // namespace mpkern
