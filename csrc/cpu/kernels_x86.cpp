// x86 kernels of moe_ops' CPU grouped matmul: AMX (bf16), AVX512-BF16 dot products (bf16 without
// AMX: the FMA kernel below on bf16 pairs, see VB) and AVX-512 FMA (fp32/fp16/fp64, and bf16 on
// CPUs with neither). grouped_mm.cpp checks the CPU and the OS before calling anything here.
//
// This file is compiled with AVX-512 and AMX code generation switched on (the pragma below), so it
// includes only C headers and keeps everything but the entry points in an anonymous namespace:
// no inline function or template instantiation of this file can be shared with, and picked by
// the linker for, code that runs on CPUs without these instructions.
//
// Work unit: one Item = rows [m0, m1) x columns [n0, n1) of one Task (C = A @ B + bias). An
// item packs its rows of A once, then walks its columns in blocks (32 for AMX, 64 for FMA),
// packs that block of B once and reuses it for all rows, and writes the block of C with its one
// rounding (bias added in fp32 before it). AMX items with more rows than fit in L2 (large
// groups) turn this around: a slice of B stays packed in L2 and the rows stream through
// (amx_item_panels). With AVX512-BF16 and no AMX (Task::bf16_scheme), bf16 with k-contiguous
// operands takes vbs_item instead: C^T = W @ A^T with the weights read in place and the rows of A
// in 256-bit lanes on CPUs that split 512-bit operations in two, 512-bit lanes on others (see
// "VB, swapped" and "The swapped scheme in 512-bit vectors"). Groups of one to
// four rows (decode; on the FMA paths up to 8 or 16) take gemv_item (dot products along k, k-contiguous
// weights; with the swapped scheme only where rows of W are a multiple of 4 KiB apart, see
// vbs_task) or gemvt_item (rows of W streamed, n-contiguous weights) instead. Every
// element of C in the item is written, so the output never needs a zero fill; k == 0 gives the
// bias or zeros.
//
// Two AMX schemes, picked by the strides of B (the expert weights in MoE):
// * direct: C = A @ B. A is packed into tiles (16 rows x 32 k), B into VNNI tiles (16 k-pairs x
//   16 columns). Used when B's rows are contiguous ([G, K, N] weights).
// * swapped: C^T = B^T @ A^T. Used when B is k-contiguous (mat_b = W.transpose(1, 2) with W a
//   [G, N, K] nn.Linear-style weight, the common case): rows of W are loaded as AMX tiles
//   straight from memory, so the weights are read once and never copied; only the (smaller)
//   activations are packed (VNNI of A^T). The epilogue transposes 16x16 blocks back. Not in
//   amx_item_panels (large groups), which packs W once per slice anyway and takes the direct
//   scheme for every layout.
// Measured on the 2-core Sapphire Rapids VM this was developed on (1 thread, G=64, M=2048,
// K=N=512, bf16): oneDNN's B packing (cpublas::pack) took 2.5-3 us per 512x64 panel and the
// brgemm ukernel 3 us per 32x64x512 call, so the packing alone equalled the AMX work; a packed
// 512x32 VNNI block here is a few hundred cycles, and the swapped scheme needs none.

#if defined(__x86_64__) || defined(_M_X64)

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16")
// The intrinsics headers use _mm512_undefined_* on purpose; GCC 12 warns about them here
// (_mm512_reduce_add_ps's, inlined into gemv_block, as -Wuninitialized).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

namespace moe_cpu {
namespace x86 {
namespace {

#include "kernel_common.h"

// The AMX operations of the kernels below: the instructions, or in a test build with
// MOE_OPS_AMX_EMULATOR our emulator of them (amx_emulator.h). Every tile has one shape,
// kTileRows rows of kTileRowBytes bytes (thread_begin's configuration): a load or store moves
// those rows, `stride` bytes apart; ASan does not see the instructions, so a sanitizer build
// checks those bytes first (check_tile).
constexpr int kTileRows = 16;
constexpr int kTileRowBytes = 64;
#if defined(MOE_OPS_AMX_EMULATOR)
#include "amx_emulator.h"
#define MOE_TILE_LOAD(t, base, stride) amx_emu::load(t, base, stride)
#define MOE_TILE_STORE(t, base, stride) amx_emu::store(t, base, stride)
#define MOE_TILE_ZERO(t) amx_emu::zero(t)
#define MOE_TILE_DPBF16PS(c, a, b) amx_emu::dpbf16ps(c, a, b)
inline void tile_config(const void* cfg) { amx_emu::config(cfg); }
inline void tile_release() { amx_emu::release(); }
#else
inline void check_tile(const void* base, int64_t stride, bool store) {
  for (int64_t r = 0; r < kTileRows; ++r) check_bytes((const char*)base + r * stride, kTileRowBytes, store);
}
#define MOE_TILE_LOAD(t, base, stride) \
  do {                                   \
    check_tile(base, stride, false);     \
    _tile_loadd(t, base, stride);        \
  } while (0)
#define MOE_TILE_STORE(t, base, stride) \
  do {                                    \
    check_tile(base, stride, true);       \
    _tile_stored(t, base, stride);        \
  } while (0)
#define MOE_TILE_ZERO(t) _tile_zero(t)
#define MOE_TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
inline void tile_config(const void* cfg) { _tile_loadconfig(cfg); }
inline void tile_release() { _tile_release(); }
#endif

inline __mmask16 mask16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
inline __mmask8 mask8(int64_t n) { return n >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << n) - 1); }
inline __mmask32 mask32(int64_t n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n) - 1); }

// ---------------------------------------------------------------------------------------------
// Masked loads and stores, the edges of every row, and streaming stores. ASan does not see them
// (kernel_common.h), so in a sanitizer build each first checks its bytes: a masked access those
// of its lanes, first to last set lane (the masks here are prefixes). Otherwise they are the
// intrinsics.
inline void check_lanes(const void* p, uint64_t mask, int lane_bytes, bool store) {
  if (mask == 0) return;
  const int lo = __builtin_ctzll(mask), hi = 63 - __builtin_clzll(mask);
  check_bytes((const char*)p + (int64_t)lo * lane_bytes, (size_t)(hi - lo + 1) * lane_bytes, store);
}
inline void stream_si512(void* p, __m512i v) { check_bytes(p, 64, true); _mm512_stream_si512((__m512i*)p, v); }
inline void stream_ps512(float* p, __m512 v) { check_bytes(p, 64, true); _mm512_stream_ps(p, v); }
inline __m512 masked_load_ps(__mmask16 m, const float* p) { check_lanes(p, m, 4, false); return _mm512_maskz_loadu_ps(m, p); }
inline __m512d masked_load_pd(__mmask8 m, const double* p) { check_lanes(p, m, 8, false); return _mm512_maskz_loadu_pd(m, p); }
inline __m128i masked_load_epi16x8(__mmask8 m, const uint16_t* p) {
  check_lanes(p, m, 2, false);
  return _mm_maskz_loadu_epi16(m, p);
}
inline __m256i masked_load_epi16x16(__mmask16 m, const uint16_t* p) {
  check_lanes(p, m, 2, false);
  return _mm256_maskz_loadu_epi16(m, p);
}
inline __m512i masked_load_epi16x32(__mmask32 m, const uint16_t* p) {
  check_lanes(p, m, 2, false);
  return _mm512_maskz_loadu_epi16(m, p);
}
inline void masked_store_ps(float* p, __mmask16 m, __m512 v) { check_lanes(p, m, 4, true); _mm512_mask_storeu_ps(p, m, v); }
inline void masked_store_pd(double* p, __mmask8 m, __m512d v) { check_lanes(p, m, 8, true); _mm512_mask_storeu_pd(p, m, v); }
inline void masked_store_ps8(float* p, __mmask8 m, __m256 v) { check_lanes(p, m, 4, true); _mm256_mask_storeu_ps(p, m, v); }
inline void masked_store_epi16x8(uint16_t* p, __mmask8 m, __m128i v) {
  check_lanes(p, m, 2, true);
  _mm_mask_storeu_epi16(p, m, v);
}
inline void masked_store_epi16x16(uint16_t* p, __mmask16 m, __m256i v) {
  check_lanes(p, m, 2, true);
  _mm256_mask_storeu_epi16(p, m, v);
}
inline void masked_store_epi16x32(uint16_t* p, __mmask32 m, __m512i v) {
  check_lanes(p, m, 2, true);
  _mm512_mask_storeu_epi16(p, m, v);
}

// ---------------------------------------------------------------------------------------------
// Vector conversions (the scalar ones are in kernel_common.h).

inline __m512 bf16x16_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m256i f32_to_bf16x16(__m512 f) {
  __m512i u = _mm512_castps_si512(f);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// The same rounding with the AVX512-BF16 conversion instructions (every CPU with AMX-BF16 has
// them; only the AMX and VB paths call these): one instruction for 16 or 32 values instead of eight
// for 16. Those instructions treat denormal inputs as zero, so a vector holding one takes the
// exact path above. Measured here (2 threads, weight gradient G=64, M=2048, K=N=512, bf16, output
// memory reused): 4.6-5.7 ms -> 2.5-3.1 ms per call; the conversion was most of the time.
inline __m256i f32_to_bf16x16_native(__m512 f) {
  if (_mm512_fpclass_ps_mask(f, 0x20)) return f32_to_bf16x16(f);  // 0x20: denormal
  return (__m256i)_mm512_cvtneps_pbh(f);
}
inline __m128i f32_to_bf16x8_native(__m256 f) {
  if (_mm256_fpclass_ps_mask(f, 0x20)) return _mm256_castsi256_si128(f32_to_bf16x16(_mm512_zextps256_ps512(f)));
  return (__m128i)_mm256_cvtneps_pbh(f);
}
inline __m512i f32_to_bf16x32_native(__m512 lo, __m512 hi) {
  if (_mm512_fpclass_ps_mask(lo, 0x20) | _mm512_fpclass_ps_mask(hi, 0x20)) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(f32_to_bf16x16(lo)), f32_to_bf16x16(hi), 1);
  }
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// Sixteen elements of a row (masked: lanes past `mask` read nothing and are zero) as fp32.
template <Dt D> inline __m512 load16_f32(const typename Ty<D>::T* p, __mmask16 m);
template <> inline __m512 load16_f32<Dt::f32>(const float* p, __mmask16 m) { return masked_load_ps(m, p); }
template <> inline __m512 load16_f32<Dt::bf16>(const uint16_t* p, __mmask16 m) {
  return bf16x16_to_f32(masked_load_epi16x16(m, p));
}
template <> inline __m512 load16_f32<Dt::f16>(const uint16_t* p, __mmask16 m) {
  return _mm512_cvtph_ps(masked_load_epi16x16(m, p));
}

// Store sixteen fp32 values (lanes in `mask`) as dtype O.
template <Dt O> inline void store16_f32(typename Ty<O>::T* p, __m512 v, __mmask16 m);
template <> inline void store16_f32<Dt::f32>(float* p, __m512 v, __mmask16 m) { masked_store_ps(p, m, v); }
template <> inline void store16_f32<Dt::bf16>(uint16_t* p, __m512 v, __mmask16 m) {
  masked_store_epi16x16(p, m, f32_to_bf16x16(v));
}
template <> inline void store16_f32<Dt::f16>(uint16_t* p, __m512 v, __mmask16 m) {
  masked_store_epi16x16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Sixteen fp32 values as dtype O to p, elements sn apart, the first `count` of them: one masked
// vector store where the row is contiguous, else one element at a time.
template <Dt O>
inline void put16_f32(typename Ty<O>::T* p, int64_t sn, __m512 v, int64_t count) {
  if (sn == 1) {
    store16_f32<O>(p, v, mask16(count));
    return;
  }
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int64_t x = 0; x < imin(16, count); ++x) Ty<O>::put(p + x * sn, tmp[x]);
}

// In-register transpose of a 16x16 block of 32-bit lanes: r[i] lane j <- r[j] lane i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    __m512d a0 = _mm512_castps_pd(t[4 * i]), a1 = _mm512_castps_pd(t[4 * i + 1]);
    __m512d a2 = _mm512_castps_pd(t[4 * i + 2]), a3 = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  // Now r[4i + x] holds, in 128-bit lane L, rows 4i..4i+3 of column 4L + x.
  for (int x = 0; x < 4; ++x) {
    t[x] = _mm512_shuffle_f32x4(r[x], r[4 + x], 0x88);
    t[4 + x] = _mm512_shuffle_f32x4(r[x], r[4 + x], 0xDD);
    t[8 + x] = _mm512_shuffle_f32x4(r[8 + x], r[12 + x], 0x88);
    t[12 + x] = _mm512_shuffle_f32x4(r[8 + x], r[12 + x], 0xDD);
  }
  for (int x = 0; x < 4; ++x) {
    r[x] = _mm512_shuffle_f32x4(t[x], t[8 + x], 0x88);
    r[8 + x] = _mm512_shuffle_f32x4(t[x], t[8 + x], 0xDD);
    r[4 + x] = _mm512_shuffle_f32x4(t[4 + x], t[12 + x], 0x88);
    r[12 + x] = _mm512_shuffle_f32x4(t[4 + x], t[12 + x], 0xDD);
  }
}

// Bias of columns [n0, n0 + count) as the accumulation type, zero past count (and with no bias),
// into dst (64-byte aligned, width a multiple of a vector). Written with whole-vector stores,
// as the epilogues read it back: a vector load that spans several smaller stores cannot take its
// data from them and waits until they commit to L1, behind every non-temporal store still in the
// store buffer, so each block's epilogue waited for the previous block's output to drain (perf,
// G=64, M=2048, K=N=512 bf16 weight gradient: 40% of the epilogue's samples on that load).
// Measured here (2 threads, 3 alternating processes, medians): that gradient 3.60-3.73 ->
// 3.24-3.49 ms, G=256, M=4096, K=512, N=256 bf16 6.34-6.99 -> 5.93-6.59 ms; fp32 and outputs
// without non-temporal stores within the noise.
template <Dt D>
void load_bias(const Task& t, int64_t n0, int64_t count, typename Ty<D>::Acc* dst, int64_t width) {
  using T = typename Ty<D>::T;
  if (t.bias != nullptr && t.bias_sn != 1) {  // a strided bias: element by element
    for (int64_t j = 0; j < width; ++j) dst[j] = j < count ? Ty<D>::get((const T*)t.bias + (n0 + j) * t.bias_sn) : 0;
    return;
  }
  const T* bias = t.bias != nullptr ? (const T*)t.bias + n0 : nullptr;
  if constexpr (D == Dt::f64) {
    for (int64_t j = 0; j < width; j += 8) {
      _mm512_store_pd(dst + j, bias != nullptr && j < count ? masked_load_pd(mask8(count - j), bias + j) : _mm512_setzero_pd());
    }
  } else {
    for (int64_t j = 0; j < width; j += 16) {
      _mm512_store_ps(dst + j, bias != nullptr && j < count ? load16_f32<D>(bias + j, mask16(count - j)) : _mm512_setzero_ps());
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Groups of one to four rows (decode; on the FMA paths up to 8 or 16, k-contiguous weights): dot products
// along k, or the rows of B streamed.

// Groups of at most kGemvRows rows (on the FMA paths see fma_gemv_rows) with k-contiguous weights (decode: one token sends one row to
// each of its top-k experts): C[m, n] = A[m, :] . W[n, :] as dot products along k. Each row of
// W is read once, in memory order, four rows at a time (four sequential streams the hardware
// prefetchers follow); the group's rows of A, converted to fp32 once, stay in L1. The blocked
// kernel below transpose-packs every 64 x K block of W, for one or two rows. Measured here
// (2 threads, fp32, one token through the expert projection of Qwen3-30B-A3B, OLMoE,
// DeepSeek-V3 /4, GPT-OSS-20B and Mixtral, experts routed anew every call, 25 alternating
// rounds, benchmarks/decode.py): 0.88-16 ms at 29-33 GB/s of weights against 1.7-31 ms at
// 14-17 GB/s for the blocked kernel, torch._grouped_mm (MKL) 23-30 GB/s; at G=64 / G=256 with
// Dirichlet group sizes (prefill) the same as the blocked kernel. With AMX (bf16) only from
// K = kGemvAmxMinK: the swapped AMX scheme reads W as tiles without packing, and measured as fast
// in decode at K = 1792-2880 and 6-8% faster at G=256, K=512 prefill (whose many tiny groups
// this kernel would take), but at Mixtral's K = 4096, N = 14336 it read 22 GB/s against 27 GB/s
// here (10.5 -> 8.5 ms; rows of W of 8 KiB make long streams). Chosen by the group's size and K,
// never the item's, so that a group's summation order does not depend on how the call was cut
// into items. bf16 with the swapped VDPBF16PS scheme (AMD Zen 4) takes this only where the rows of
// W are a multiple of 4 KiB apart (see vbs_task).
constexpr int64_t kGemvRows = 4;
// fp32, and bf16 converted to fp32 (the "avx512" level), on the FMA path: groups of up to 16
// rows, in passes of 4 over each block of W's rows.
// The blocked kernel transpose-packs every 64 x K panel of W for its few rows: with one weight
// matrix shared by all groups (the compute alone; G=256, K=512, N=256, 2 threads, caches
// flushed) groups of 4 rows took 1.94 ms here and groups of 5 on the blocked kernel 4.03 ms
// (dense 1.65 / 2.22 ms). Measured on the Zen 4 VM (2 threads, one process alternating, caches
// flushed, 10-12 rounds, medians, 2026-12-01), blocked -> this, every group of G=256, K=512,
// N=256 of 5 / 6 / 7 / 8 rows: 9.19 / 8.36 / 9.47 / 8.59 -> 5.86 / 5.54 / 5.77 / 6.03 ms (the
// 128 MiB of weights at ~26 GB/s take 5.0). The issue's forward shapes (Dirichlet sizes): G=256
// 9.98 -> 9.83 ms, DeepSeek-V3 /16 4.90 -> 4.78, the rest level; decode ([G, N, K] weights, 16 /
// 32 tokens): Mixtral 92.9 / 118.7 -> 68.1 / 88.7 ms, GPT-OSS-20B 27.4 / 43.2 -> 26.2 / 33.7,
// OLMoE-1B-7B 15.9 / 21.1 -> 15.5 / 15.3, Qwen3-30B-A3B 18.6 / 23.1 -> 17.9 / 21.4, DeepSeek-V3
// /4 level. 9-16 rows, in up to four passes (gemv_passes), measured on the Zen 4 VM on
// 2026-12-07 (same method, 12-20 rounds), 8 -> 16: groups of 9 / 10 / 12 / 14 / 16 / 20 rows, all
// G=256 (K=512, N=256) read, 6.40 / 7.32 / 8.04 / 7.67 / 7.85 / 9.16 -> 5.42 / 5.83 / 6.45 / 6.68 /
// 7.49 / 9.19 ms; one matrix shared by all groups (the compute alone, M=2048, K=N=512, ratio to
// dense) 9 / 12 / 16 / 24 / 32 rows x1.55 / x1.35 / x1.31 / x1.08 / x1.06 -> x1.09 / x1.07 /
// x1.09 / (blocked) x1.07 / x1.07; the issue's forward G=64 7.54 -> 7.42 ms and 7.55 -> 7.31 ms,
// G=256 8.86 -> 8.57 ms and 9.20 -> 8.90 ms, G=8 level; 64 / 128 tokens routed top-2 to 8
// experts (K=4096, N=3584) 18.99 / 29.83 -> 17.45 / 26.92 ms. (On 2026-12-01 three passes for
// 9-12 rows had measured level or slower, 6.76 / 7.38 / 7.18 / 7.51 -> 6.85 / 7.03 / 7.46 / 7.93
// ms: not so today.) 17-24 rows stay blocked: 20 rows level. bf16 on the "avx512" level
// (converted to fp32: Intel CPUs with AVX-512 but neither AVX512-BF16 nor AMX; measured here with
// that level forced), 4 -> 16, every group of G=256, K=512, N=256 read, groups of 5 / 6 / 8 / 10 /
// 12 / 16 / 20 rows: 5.09 / 5.38 / 6.35 / 7.22 / 7.84 / 8.87 / 10.69 -> 3.07 / 3.39 / 4.35 / 5.54
// / 6.20 / 8.18 / 10.66 ms; the same with one matrix shared by all groups alike.
constexpr int64_t kGemvRowsFma = 16;
// fp16 (converted to fp32 on the FMA path): each pass converts W's rows again, and from 10 rows
// the blocked kernel is as fast. Measured as above, 4 -> 16, groups of 5 / 6 / 8 / 10 / 12 / 16
// rows: 3.48 / 3.85 / 4.72 / 5.06 / 5.75 / 7.04 -> 3.05 / 3.38 / 4.21 / 5.23 / 6.01 / 7.88 ms,
// hence 8. (bf16 on VDPBF16PS, the "avx512_bf16" level's direct scheme, whose blocked kernel is
// twice as fast, keeps kGemvRows: 5 / 6 rows 4.62 / 3.84 -> 3.01 / 3.32 ms, 8 rows level, 10-16
// rows 23-52% slower; the machine's default there is the swapped scheme anyway.)
constexpr int64_t kGemvRowsF16 = 8;
constexpr int64_t kGemvAmxMinK = 4096;  // see amx_item
// Rows of W ahead (the next block of four) that gemv_block prefetches into L2, one line per line
// it reads. Without it every row of K >= 2048 bf16 starts a fresh 4 KiB page that the hardware
// prefetchers do not enter. Measured on the Zen 4 VM (benchmarks/decode.py's [G, N, K] cases, 2
// threads, one process alternating, 15 rounds, 2026-12-01), without -> with: bf16 OLMoE-1B-7B
// 1.16 / 1.25 -> 0.77 / 1.01 ms, Qwen3-30B-A3B 0.98 / 0.88 -> 0.58 / 0.57 ms, Mixtral 7.76 / 7.58
// -> 6.98 / 7.14 ms; fp32 Qwen3-30B-A3B 1.55 -> 1.40 ms, DeepSeek-V3 /4 1.01 -> 0.83 ms, the rest
// level; fp32 prefill with every group of G=256, K=512, N=256 read, groups of 1 / 4 rows 5.61 /
// 7.62 -> 4.47 / 4.29 ms, the issue's G=256 forward 9.08 -> 8.63 ms. 8 or 16 rows ahead measured
// the same.
constexpr int64_t kGemvAheadRows = 4;

// WM, where the NJ rows of W come from: 0 W, 1 W with their fp32 values also stored into wbuf
// (NJ rows, lda apart), 2 wbuf (see gemv_passes).
template <Dt D, Dt O, int R, int NJ, int WM = 0>
inline void gemv_block(const Task& t, const Item& it, const float* ap, int64_t lda, int64_t n, const float* bias,
                       float* wbuf = nullptr) {
  using T = typename Ty<D>::T;
  const int64_t K = t.k;
  const T* w = (const T*)t.b + n * t.b_sn;
  __m512 acc[NJ][R];
#pragma GCC unroll 4
  for (int j = 0; j < NJ; ++j) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 km = mask16(K - k);
    __m512 wv[NJ];
    if constexpr (WM == 2) {
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) wv[j] = _mm512_load_ps(wbuf + j * lda + k);
    } else {
      if (((k * (int64_t)sizeof(T)) & 63) == 0) {  // the next block's rows (a prefetch never faults)
#pragma GCC unroll 4
        for (int j = 0; j < NJ; ++j) _mm_prefetch((const char*)(w + (j + kGemvAheadRows) * t.b_sn + k), _MM_HINT_T1);
      }
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) {
        wv[j] = load16_f32<D>(w + j * t.b_sn + k, km);
        if constexpr (WM == 1) _mm512_store_ps(wbuf + j * lda + k, wv[j]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_load_ps(ap + r * lda + k);
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) acc[j][r] = _mm512_fmadd_ps(wv[j], av, acc[j][r]);
    }
  }
  using TO = typename Ty<O>::T;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    TO* crow = (TO*)t.c + (it.m0 + r) * t.c_sm;
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) Ty<O>::put(crow + (n + j) * t.c_sn, _mm512_reduce_add_ps(acc[j][r]) + bias[j]);
  }
}

// Passes of up to 4 rows over one block of NJ rows of W while it is in L1 (each row's sums do
// not depend on which pass it is in). bf16 / fp16 rows of W are converted once: the first pass
// keeps their fp32 values in wbuf, which the later passes read (the same values, so the same
// sums). Measured on the Zen 4 VM (2 threads, one process alternating, caches flushed, 12
// rounds, medians, 2026-12-07; the "avx512" level forced), converting in every pass -> once,
// every group of G=256, K=512, N=256 read: bf16 groups of 5 / 8 / 10 / 12 / 16 rows 3.85 / 4.99 /
// 5.94 / 6.75 / 8.49 -> 3.78 / 4.79 / 5.74 / 6.38 / 7.85 ms; fp16 5 / 8 rows 3.40 / 4.65 -> 3.22
// / 4.33 ms (10-16 rows 5.41 / 6.00 / 7.47 ms, still behind the blocked kernel's 5.28 / 5.90 /
// 7.08: see kGemvRowsF16).
template <Dt D, Dt O, int NJ, int R, int WM = (D != Dt::f32 && R > 4) ? 1 : 0>
inline void gemv_passes(const Task& t, const Item& it, const float* ap, int64_t lda, int64_t n, const float* bias,
                        float* wbuf) {
  constexpr int R0 = R > 4 ? 4 : R;
  gemv_block<D, O, R0, NJ, WM>(t, it, ap, lda, n, bias, wbuf);
  if constexpr (R > R0) {
    Item hi = it;
    hi.m0 += R0;
    gemv_passes<D, O, NJ, R - R0, WM == 0 ? 0 : 2>(t, hi, ap + R0 * lda, lda, n, bias, wbuf);
  }
}

template <Dt D, Dt O, int R>
void gemv_rows(const Task& t, const Item& it, const float* ap, int64_t lda, float* wbuf) {
  alignas(64) float bias[16];
  for (int64_t n = it.n0; n < it.n1;) {
    if (it.n1 - n >= 4) {
      load_bias<D>(t, n, 4, bias, 16);
      gemv_passes<D, O, 4, R>(t, it, ap, lda, n, bias, wbuf);
      n += 4;
    } else {
      load_bias<D>(t, n, 1, bias, 16);
      gemv_passes<D, O, 1, R>(t, it, ap, lda, n, bias, wbuf);
      n += 1;
    }
  }
}

// The item's rows of A as fp32 in the workspace, lda apart, zero past K.
template <Dt D>
float* gemv_pack_rows(const Task& t, const Item& it, void* ws, int64_t lda) {
  using T = typename Ty<D>::T;
  float* ap = (float*)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
  for (int64_t r = 0; r < it.m1 - it.m0; ++r) {
    const T* a = (const T*)t.a + (it.m0 + r) * t.a_sm;
    for (int64_t k = 0; k < lda; ++k) ap[r * lda + k] = k < t.k ? (float)Ty<D>::get(a + k * t.a_sk) : 0.0f;
  }
  return ap;
}

// The largest group that gemv_item serves in dtype D, and that fma_item sends it (VT: fma_item's
// vectors; VDPBF16PS pairs keep kGemvRows).
template <Dt D>
constexpr int64_t gemv_max_rows() {
  return D == Dt::f16 ? kGemvRowsF16 : kGemvRowsFma;
}
template <class VT, Dt D>
constexpr int64_t fma_gemv_rows() {
  return VT::kPairs ? kGemvRows : gemv_max_rows<D>();
}

// gemv_rows for the item's `rows`, R at most (the callers take no larger groups).
template <Dt D, Dt O, int R>
void gemv_rows_upto(const Task& t, const Item& it, const float* ap, int64_t lda, int64_t rows, float* wbuf) {
  if constexpr (R > 1) {
    if (rows < R) return gemv_rows_upto<D, O, R - 1>(t, it, ap, lda, rows, wbuf);
  }
  gemv_rows<D, O, R>(t, it, ap, lda, wbuf);
}

template <Dt D, Dt O>
void gemv_item(const Task& t, const Item& it, void* ws) {
  const int64_t rows = it.m1 - it.m0, lda = round_up(t.k, 16);
  float* ap = gemv_pack_rows<D>(t, it, ws, lda);
  // wbuf (4 rows of W as fp32, for gemv_passes) after the packed rows of A: 20 x lda floats, within
  // fma_workspace (its A panel takes at least 6 x lda, its B panel 64 x K floats) wherever a
  // group of more than 4 rows comes here.
  gemv_rows_upto<D, O, gemv_max_rows<D>()>(t, it, ap, lda, rows, ap + kGemvRowsFma * lda);
}

// The same groups with n-contiguous weights (W stored [G, K, N], as the input gradient reads the
// forward's [G, N, K] weights, or models that keep their experts [G, K, N]): C[m, :] = sum over k
// of A[m, k] * W[k, :]. Rows of W are read in memory order, four side by side, across all of the
// item's columns (up to kGemvtCols at a time), scaled by A[m, k] and added into fp32 sums of the
// item's rows kept in L1/L2 (y), while rows further on are prefetched (kGemvtAheadBytes); such a
// task is cut into as few column pieces as the threads need (whole_row_items), so that an item
// reads whole rows, i.e. its expert's matrix front to back. Each output element is summed over k
// in order, as in the blocked FMA kernel (the results are the same bit for bit); bf16 with AMX
// takes it too (the tile kernel VNNI-packed all of W for a row or two). Measured here
// (benchmarks/decode.py, 2 threads, one token, experts routed anew every call, [G, K, N]
// weights): fp32 Qwen3-30B-A3B / OLMoE / GPT-OSS-20B / Mixtral 2.8-3.1 / 3.5-3.8 / 8.4-9.4 / -
// ms with the blocked kernel, 1.7-1.8 / 2.0-2.1 / 4.2-4.5 / 15.4-15.9 ms with this (Mixtral with
// kGemvtPrefetchBelow), torch._grouped_mm 2.0 / 2.5 / 4.4 / 15.4-15.8 ms; bf16 0.9-1.0 / 1.1 /
// 2.2-2.6 / 8.3-8.7 ms against 1.6-1.8 / 2.1-2.5 / 4.2-4.8 / 12.3 ms on the tiles and
// torch._grouped_mm 2.1-2.2 / 3.0 / 6.5-6.7 / 24 ms. One row
// per pass with y read and written per row instead: fp32 Mixtral 23 ms, GPT-OSS 5.0-5.3 ms;
// register strips of 256 columns per pass over K (1 KiB runs per row): GPT-OSS 6.6 ms; items cut
// for 8 per thread: 5.4-5.8 ms; eight rows side by side: Mixtral 18.8 ms. G=64 / G=256 prefill
// input gradients unchanged (alternating A/B, within 4%).
constexpr int64_t kGemvtCols = 16384;
constexpr int64_t kGemvtAheadRows = 4;
// Software prefetch only for runs of W shorter than this per row: longer ones the hardware
// prefetchers stream alone, and the prefetches got in their way. Measured (2 threads, 16
// alternating rounds, [G, K, N] weights) with / without: fp32 Mixtral (56 KiB runs) 16.7 / 14.8
// ms (torch._grouped_mm 14.7), bf16 8.3 / 7.9; fp32 Qwen3-30B-A3B (3 KiB) 1.63 / 1.83, GPT-OSS
// (11 KiB) 4.1 / 4.3, bf16 0.85 / 1.43 and 1.9 / 2.6 ms.
constexpr int64_t kGemvtPrefetchBelow = 16 * 1024;
// Those prefetches go to L2 (T1), at least kGemvtAheadRows and kGemvtAheadBytes ahead. Into L1
// (T0) and 4 rows ahead, as first written, one core read 8.5 GB/s here (perf: the samples on the
// loads of W), and the distance made no difference. Measured on the Zen 4 VM (2 threads, one
// process alternating, 2026-12-01), T0 4 rows -> T1 16 KiB: decode ([G, K, N] weights, 1 / 4
// tokens) bf16 OLMoE-1B-7B 1.40 / 4.66 -> 0.83 / 3.54 ms, Qwen3-30B-A3B 1.13 / 3.86 -> 0.61 /
// 2.83 ms, DeepSeek-V3 /4 0.70 / 2.92 -> 0.31 / 1.45 ms, GPT-OSS-20B 2.29 / 8.02 -> 1.95 / 7.14 ms;
// fp32 the same four 2.22 / 1.95 / 1.28 / 4.42 -> 1.90 / 1.59 / 0.97 / 3.94 ms; prefill with
// every group of G=256, K=512, N=256 read, groups of 1 / 4 rows: bf16 3.59 / 3.96 -> 2.22 / 2.55
// ms, fp32 6.42 / 7.19 -> 4.49 / 4.66 ms; the issue's G=256 input gradient (a fifth of its
// groups of 1-4 rows) bf16 4.76 -> 4.64 ms, fp32 8.65 -> 8.29 ms. T1 at 4 rows (2 KiB here) /
// 16 KiB / 32 KiB / 64 KiB: within 10% of each other, 16 KiB the best overall. The rows past the
// threshold above with these prefetches: bf16 Mixtral 5.68 -> 5.18 ms, fp32 14.13 -> 15.04 ms.
constexpr int64_t kGemvtAheadBytes = 16 * 1024;

constexpr int64_t kWideCols = 1024;  // widest block of B rows fma_item packs at once

// With VB (bf16 pairs: AVX512-BF16 without AMX) groups of 3 and 4 rows take the blocked kernel
// instead where a row of W fits in one of its slabs (N <= kWideCols, so that it reads W as whole
// rows, in memory order): there it sums pairs with VDPBF16PS where this kernel converts W to fp32
// for FMAs. Measured on the Zen 4 VM (2 threads, [G, K, N] weights, one process alternating,
// caches flushed, 12-30 rounds, medians, 2026-12-07), this -> blocked: M=4096, K=256, N=512,
// groups of 4 / 3 rows from cache (one W for all) 8.44 / 9.11 -> 5.76 / 6.47 ms, read 15.69 /
// 15.19 -> 13.51 / 13.22 ms; the issue's G=256 input gradient (Dirichlet sizes) 5.03 / 6.56 /
// 5.00 / 5.27 -> 4.76 / 6.14 / 4.81 / 5.10 ms (four runs), G=64 and the model shapes' input
// gradients level; decode (routed as benchmarks/decode.py routes, [G, K, N] weights, 16 / 32
// tokens) level: OLMoE-1B-7B 8.20 / 12.15 -> 8.15 / 11.60 ms, Qwen3-30B-A3B 10.40 / 11.27 -> 10.09
// / 11.63 ms, DeepSeek-V3 /4 8.11 / 8.93 -> 8.28 / 9.22 ms. With wider rows (slabs of part of a
// row) the blocked kernel was slower: GPT-OSS-20B (N = 2880) 18.21 / 26.21 -> 22.56 / 33.54 ms,
// Mixtral (N = 14336) 60.22 -> 71.22 ms at 16 tokens; and for groups of 1 / 2 rows (read) 29.78 /
// 21.76 -> 35.60 / 21.11 ms. fp32 keeps this kernel for 1-4 rows (groups of 4 from cache 7.80 ->
// 8.44 ms on the blocked one, read 21.03 -> 20.60 ms).
constexpr int64_t kGemvtPairsRows = 2;
bool gemvt_task(const Task& t, bool pairs) {
  const int64_t rows = pairs && t.n <= kWideCols ? kGemvtPairsRows : kGemvRows;
  return t.b_sn == 1 && t.b_sk != 1 && t.m <= rows;
}

// Rows k0 .. k0 + KB - 1 of W added into y: KB rows streamed side by side, y read and written
// once per KB rows; each element still sums its k in order (one fma per row, in registers).
template <Dt D, int R, int KB>
inline void gemvt_rows_into(const Task& t, const float* ap, int64_t lda, const typename Ty<D>::T* b, int64_t k0,
                            int64_t nc, float* y, int64_t ldy, bool prefetch) {
  using T = typename Ty<D>::T;
  const int64_t nv = ceil_div(nc, 16);
  const T* row[KB];
  __m512 av[KB][R];
#pragma GCC unroll 4
  for (int q = 0; q < KB; ++q) {
    row[q] = b + (k0 + q) * t.b_sk;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) av[q][r] = _mm512_set1_ps(ap[r * lda + k0 + q]);
  }
  const int64_t ahead_rows = imax(kGemvtAheadRows, kGemvtAheadBytes / imax(nc * (int64_t)sizeof(T), 1));
  const char* ahead = (const char*)(b + (k0 + KB + ahead_rows) * t.b_sk);  // a prefetch never faults
  for (int64_t j = 0; j < nv; ++j) {
    if (prefetch && (j * 16 * (int64_t)sizeof(T)) % 64 == 0) {
#pragma GCC unroll 4
      for (int q = 0; q < KB; ++q) _mm_prefetch(ahead + q * t.b_sk * (int64_t)sizeof(T) + j * 16 * sizeof(T), _MM_HINT_T1);
    }
    const __mmask16 cm = mask16(nc - 16 * j);
    __m512 bv[KB];
#pragma GCC unroll 4
    for (int q = 0; q < KB; ++q) bv[q] = load16_f32<D>(row[q] + 16 * j, cm);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float* yp = y + r * ldy + 16 * j;
      __m512 acc = _mm512_load_ps(yp);
#pragma GCC unroll 4
      for (int q = 0; q < KB; ++q) acc = _mm512_fmadd_ps(av[q][r], bv[q], acc);
      _mm512_store_ps(yp, acc);
    }
  }
}

template <Dt D, int R>
void gemvt_chunk(const Task& t, const float* ap, int64_t lda, int64_t n0, int64_t nc, float* y) {
  const int64_t ldy = round_up(nc, 16);
  for (int64_t i = 0; i < R * ldy; i += 16) _mm512_store_ps(y + i, _mm512_setzero_ps());
  const auto* b = (const typename Ty<D>::T*)t.b + n0 * t.b_sn;
  const bool prefetch = nc * (int64_t)sizeof(typename Ty<D>::T) < kGemvtPrefetchBelow;
  int64_t k = 0;
  for (; k + 4 <= t.k; k += 4) gemvt_rows_into<D, R, 4>(t, ap, lda, b, k, nc, y, ldy, prefetch);
  for (; k < t.k; ++k) gemvt_rows_into<D, R, 1>(t, ap, lda, b, k, nc, y, ldy, prefetch);
}

template <Dt D, Dt O, int R>
void gemvt_rows(const Task& t, const Item& it, const float* ap, int64_t lda, float* y) {
  using TO = typename Ty<O>::T;
  alignas(64) float bias[16];
  for (int64_t n0 = it.n0; n0 < it.n1; n0 += kGemvtCols) {
    const int64_t nc = imin(kGemvtCols, it.n1 - n0), ldy = round_up(nc, 16);
    gemvt_chunk<D, R>(t, ap, lda, n0, nc, y);
    for (int64_t j = 0; j < nc; j += 16) {
      load_bias<D>(t, n0 + j, imin(16, nc - j), bias, 16);
      const __m512 bv = _mm512_load_ps(bias);
      for (int64_t r = 0; r < R; ++r) {
        TO* c = (TO*)t.c + (it.m0 + r) * t.c_sm + (n0 + j) * t.c_sn;
        put16_f32<O>(c, t.c_sn, _mm512_add_ps(_mm512_load_ps(y + r * ldy + j), bv), nc - j);
      }
    }
  }
}

// Workspace: the rows of A (gemv_pack_rows), then y (at most kGemvRows x kGemvtCols floats,
// 256 KiB) past 4 rows of A: within both fma_workspace (>= 512 KiB of B panels besides 6 rows of
// A; asserted below) and amx_workspace (>= 1 MiB of B slice besides 32 rows of A).
template <Dt D, Dt O>
void gemvt_item(const Task& t, const Item& it, void* ws) {
  const int64_t lda = round_up(imax(t.k, 1), 16);
  const float* ap = gemv_pack_rows<D>(t, it, ws, lda);
  float* y = (float*)(((uintptr_t)(ap + kGemvRows * lda) + 63) & ~(uintptr_t)63);
  switch (it.m1 - it.m0) {
    case 4: gemvt_rows<D, O, 4>(t, it, ap, lda, y); break;
    case 3: gemvt_rows<D, O, 3>(t, it, ap, lda, y); break;
    case 2: gemvt_rows<D, O, 2>(t, it, ap, lda, y); break;
    default: gemvt_rows<D, O, 1>(t, it, ap, lda, y); break;
  }
}

// ---------------------------------------------------------------------------------------------
// AMX (bf16 in, fp32 accumulation). Tiles: 0-3 accumulators (16 x 16 fp32), 4-5 the left
// operand (16 rows x 32 bf16 of k), 6-7 the right operand in VNNI form (16 k-pairs x 16
// columns x 2). A packed operand is stored tile after tile, [tile][k-step][16][32] bf16, so a
// tile is 1 KiB of contiguous memory (no cache-set conflicts whatever K is).

constexpr int64_t kTileElems = kTileRows * kTileRowBytes / 2;  // 16 x 32 bf16
constexpr int64_t kAmxBufRows = 256;  // most rows (and packed columns) of one AMX item

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Rows of a [rows x K] matrix (strides sm, sk) into tiles, zero-padded to 16 rows and 32 k.
void pack_rows_tiles(const uint16_t* src, int64_t sm, int64_t sk, int64_t rows, int64_t K, uint16_t* dst) {
  const int64_t ks = ceil_div(K, 32), mts = ceil_div(rows, 16);
  if (sk == 1) {
    for (int64_t r = 0; r < mts * 16; ++r) {
      uint16_t* d = dst + (r / 16) * ks * kTileElems + (r % 16) * 32;
      for (int64_t s = 0; s < ks; ++s) {
        __m512i v = r < rows ? masked_load_epi16x32(mask32(K - s * 32), src + r * sm + s * 32)
                             : _mm512_setzero_si512();
        _mm512_storeu_si512(d + s * kTileElems, v);
      }
    }
  } else if (sm == 1) {
    // Column-major source (e.g. x^T in the weight gradient): for each tile, interleave pairs of
    // k-rows into 32-bit words (one word = two consecutive k of one output row), then transpose.
    for (int64_t mt = 0; mt < mts; ++mt) {
      const __mmask16 rm = mask16(rows - mt * 16);
      for (int64_t s = 0; s < ks; ++s) {
        __m512 w[16];
        for (int64_t q = 0; q < 16; ++q) {
          const int64_t k0 = s * 32 + 2 * q;
          __m256i lo = k0 < K ? masked_load_epi16x16(rm, src + k0 * sk + mt * 16) : _mm256_setzero_si256();
          __m256i hi = k0 + 1 < K ? masked_load_epi16x16(rm, src + (k0 + 1) * sk + mt * 16) : _mm256_setzero_si256();
          w[q] = _mm512_castsi512_ps(
              _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16)));
        }
        transpose16(w);
        uint16_t* d = dst + (mt * ks + s) * kTileElems;
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps((float*)(d + i * 32), w[i]);
      }
    }
  } else {
    for (int64_t r = 0; r < mts * 16; ++r) {
      uint16_t* d = dst + (r / 16) * ks * kTileElems + (r % 16) * 32;
      for (int64_t s = 0; s < ks; ++s) {
        for (int64_t c = 0; c < 32; ++c) {
          const int64_t k = s * 32 + c;
          d[s * kTileElems + c] = (r < rows && k < K) ? src[r * sm + k * sk] : (uint16_t)0;
        }
      }
    }
  }
}

// A [K x cols] matrix (strides sk, sn) into VNNI tiles: tile (nt, s) row r holds, for columns
// nt*16 .. +15, the pairs (k, k+1) with k = s*32 + 2r. Zero-padded to 16 columns and 32 k.
void pack_vnni_tiles(const uint16_t* src, int64_t sk, int64_t sn, int64_t K, int64_t cols, uint16_t* dst) {
  const int64_t ks = ceil_div(K, 32), nts = ceil_div(cols, 16);
  if (sn == 1) {
    // n-contiguous source (the input gradient's [K, N] weights, the weight gradient's dy): two
    // tiles at a time, each written whole, row after row: a 64-byte piece (32 columns) of rows k
    // and k+1, interleaved into 32-bit words by two permutes, gives row r of tile nt (columns
    // 0-15) and of tile nt + 1 (16-31). Rows of B are read into L1 one tile step ahead (32 rows
    // further on, the same columns; past the item's last row they are the next group's weights,
    // [G, K, N] contiguous, which this thread usually packs next; a prefetch never faults).
    // Before (2026-11-30) each pair of rows was read in memory order, 32 bytes per tile, into
    // row r of every tile of the slice at once, with the prefetches spread over it (one line of
    // each row per 64 bytes packed; as one burst before it, perf put ~40% of the pack's samples
    // on them). Measured on an Intel AMX VM (2026-12-02; C, one thread, a 512 x 512 matrix):
    // 18.6 -> 13.5 us a pack from L2, 49.7 -> 42.6 us from memory (128 MiB of weights); the op,
    // input gradient, 2 threads, 20-30 rounds alternating in one process, 48 MiB written between
    // calls, ratio to dense: G=8, M=4096, K=1024, N=2048 x1.28 / x1.33 -> x1.24 / x1.32; G=64,
    // M=2048, K=N=512 x2.79 / x3.25 -> x2.61 / x3.15; G=256, M=4096, K=512, N=256 x5.20 / x6.07
    // -> x5.05 / x5.86 (weight gradient level). 64 rows ahead or prefetcht1: no better.
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                            37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t s = 0; s < ks; ++s) {
      for (int64_t nt = 0; nt < nts; nt += 2) {
        const __mmask32 cm = mask32(cols - nt * 16);
        uint16_t* d0 = dst + (nt * ks + s) * kTileElems;
        uint16_t* d1 = d0 + ks * kTileElems;
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t k0 = s * 32 + 2 * r;
          const char* ahead = (const char*)((uintptr_t)src + ((k0 + 32) * sk + nt * 16) * 2);
          _mm_prefetch(ahead, _MM_HINT_T0);
          _mm_prefetch(ahead + sk * 2, _MM_HINT_T0);
          const __m512i lo = k0 < K ? masked_load_epi16x32(cm, src + k0 * sk + nt * 16) : _mm512_setzero_si512();
          const __m512i hi = k0 + 1 < K ? masked_load_epi16x32(cm, src + (k0 + 1) * sk + nt * 16) : _mm512_setzero_si512();
          _mm512_storeu_si512(d0 + r * 32, _mm512_permutex2var_epi16(lo, lo_idx, hi));
          if (nt + 1 < nts) _mm512_storeu_si512(d1 + r * 32, _mm512_permutex2var_epi16(lo, hi_idx, hi));
        }
      }
    }
  } else if (sk == 1) {
    // k-contiguous source: a pair (k, k+1) of one column is one 32-bit word already; a tile is
    // the transpose of 16 columns x 16 words.
    for (int64_t nt = 0; nt < nts; ++nt) {
      for (int64_t s = 0; s < ks; ++s) {
        const __mmask32 km = mask32(K - s * 32);
        __m512 w[16];
        for (int64_t c = 0; c < 16; ++c) {
          const int64_t n = nt * 16 + c;
          w[c] = n < cols ? _mm512_castsi512_ps(masked_load_epi16x32(km, src + n * sn + s * 32))
                          : _mm512_setzero_ps();
        }
        transpose16(w);
        uint16_t* d = dst + (nt * ks + s) * kTileElems;
        for (int64_t r = 0; r < 16; ++r) _mm512_storeu_ps((float*)(d + r * 32), w[r]);
      }
    }
  } else {
    for (int64_t nt = 0; nt < nts; ++nt) {
      for (int64_t s = 0; s < ks; ++s) {
        uint16_t* d = dst + (nt * ks + s) * kTileElems;
        for (int64_t r = 0; r < 16; ++r) {
          for (int64_t c = 0; c < 16; ++c) {
            const int64_t n = nt * 16 + c;
            for (int64_t p = 0; p < 2; ++p) {
              const int64_t k = s * 32 + 2 * r + p;
              d[r * 32 + c * 2 + p] = (n < cols && k < K) ? src[k * sk + n * sn] : (uint16_t)0;
            }
          }
        }
      }
    }
  }
}

// C (MT x NT tiles of 16 x 16 fp32, row stride ldc floats) = sum over ks k-steps of left tiles
// (rows at a0 / a1, `a_stride` bytes apart, advancing `a_step` elements per k-step) times
// right VNNI tiles (contiguous, one KiB per k-step, at b0 / b1). Each k-step s also prefetches
// (into L2) the lines pf.p + r * pf.stride + s * pf.step for r < pf.lines: the caller points it
// at what it reads next from memory.
struct AmxPrefetch {
  const char* p = nullptr;
  int64_t lines = 0, stride = 0, step = 0;
  // A run of contiguous lines, an equal share at each of `steps` k-steps.
  static AmxPrefetch spread(const PfRun& run, int64_t steps) {
    AmxPrefetch pf;
    pf.p = run.first;
    pf.lines = ceil_div(run.lines, imax(steps, 1));
    pf.stride = 64;
    pf.step = pf.lines * 64;
    return pf;
  }
};

template <int MT, int NT>
inline void amx_block(const uint16_t* a0, const uint16_t* a1, int64_t a_stride, int64_t a_step,
                      const uint16_t* b0, const uint16_t* b1, int64_t ks, float* c, int64_t ldc,
                      const AmxPrefetch& pf, bool accumulate) {
  const int64_t ldb = ldc * 4;
  if (accumulate) {
    MOE_TILE_LOAD(0, c, ldb);
    if (NT == 2) MOE_TILE_LOAD(1, c + 16, ldb);
    if (MT == 2) MOE_TILE_LOAD(2, c + 16 * ldc, ldb);
    if (MT == 2 && NT == 2) MOE_TILE_LOAD(3, c + 16 * ldc + 16, ldb);
  } else {
    MOE_TILE_ZERO(0);
    if (NT == 2) MOE_TILE_ZERO(1);
    if (MT == 2) MOE_TILE_ZERO(2);
    if (MT == 2 && NT == 2) MOE_TILE_ZERO(3);
  }
  for (int64_t s = 0; s < ks; ++s) {
    for (int64_t r = 0; r < pf.lines; ++r) _mm_prefetch(pf.p + r * pf.stride + s * pf.step, _MM_HINT_T1);
    MOE_TILE_LOAD(4, a0 + s * a_step, a_stride);
    if (MT == 2) MOE_TILE_LOAD(5, a1 + s * a_step, a_stride);
    MOE_TILE_LOAD(6, b0 + s * kTileElems, 64);
    if (NT == 2) MOE_TILE_LOAD(7, b1 + s * kTileElems, 64);
    MOE_TILE_DPBF16PS(0, 4, 6);
    if (NT == 2) MOE_TILE_DPBF16PS(1, 4, 7);
    if (MT == 2) MOE_TILE_DPBF16PS(2, 5, 6);
    if (MT == 2 && NT == 2) MOE_TILE_DPBF16PS(3, 5, 7);
  }
  MOE_TILE_STORE(0, c, ldb);
  if (NT == 2) MOE_TILE_STORE(1, c + 16, ldb);
  if (MT == 2) MOE_TILE_STORE(2, c + 16 * ldc, ldb);
  if (MT == 2 && NT == 2) MOE_TILE_STORE(3, c + 16 * ldc + 16, ldb);
}

inline void amx_dispatch(int mt, int nt, const uint16_t* a0, const uint16_t* a1, int64_t a_stride, int64_t a_step,
                         const uint16_t* b0, const uint16_t* b1, int64_t ks, float* c, int64_t ldc,
                         const AmxPrefetch& pf = {}, bool accumulate = false) {
  if (mt == 2 && nt == 2) amx_block<2, 2>(a0, a1, a_stride, a_step, b0, b1, ks, c, ldc, pf, accumulate);
  else if (mt == 2) amx_block<2, 1>(a0, a1, a_stride, a_step, b0, b1, ks, c, ldc, pf, accumulate);
  else if (nt == 2) amx_block<1, 2>(a0, a1, a_stride, a_step, b0, b1, ks, c, ldc, pf, accumulate);
  else amx_block<1, 1>(a0, a1, a_stride, a_step, b0, b1, ks, c, ldc, pf, accumulate);
}

// Streaming (non-temporal) stores for a Task::stream output, where a store is a whole aligned
// line: a 32-column bf16 row piece at (row0, col0) on every row, or 16 floats / 32 bf16 at p.
inline bool stream_bf16_rows(const Task& t, const uint16_t* c, int64_t row0, int64_t col0, int64_t cols) {
  return t.stream && cols == 32 && ((uintptr_t)(c + row0 * t.c_sm + col0) & 63) == 0 && (t.c_sm & 31) == 0;
}
inline bool stream_f32x16(const Task& t, const void* p, int64_t cols_left) {
  return t.stream && cols_left >= 16 && t.c_sn == 1 && ((uintptr_t)p & 63) == 0;
}
inline bool stream_bf16x32(const Task& t, const void* p, int64_t cols_left) {
  return t.stream && cols_left >= 32 && t.c_sn == 1 && ((uintptr_t)p & 63) == 0;
}
// One row piece of up to 32 bf16 (the columns in cm) at p: streamed (nt: all 32, line-aligned).
inline void put_bf16x32(uint16_t* p, __m512i v, __mmask32 cm, bool nt) {
  if (nt) stream_si512(p, v);
  else masked_store_epi16x32(p, cm, v);
}

// Writes rows [0, rows) x columns [0, cols) of an fp32 block (row stride ldb) plus bias to C at
// (row0, col0), rounding once to O.
template <Dt O>
void store_block(const Task& t, int64_t row0, int64_t col0, const float* blk, int64_t ldb, int64_t rows,
                 int64_t cols, const float* bias) {
  using TO = typename Ty<O>::T;
  TO* c = (TO*)t.c;
  if (O == Dt::bf16 && t.c_sn == 1 && cols <= 32) {  // the usual case: one 64-byte row piece
    const __m512 b0 = _mm512_loadu_ps(bias), b1 = _mm512_loadu_ps(bias + 16);
    const __mmask32 cm = mask32(cols);
    const bool nt = stream_bf16_rows(t, (const uint16_t*)c, row0, col0, cols);
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(blk + i * ldb), b0);
      const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(blk + i * ldb + 16), b1);
      put_bf16x32((uint16_t*)c + (row0 + i) * t.c_sm + col0, f32_to_bf16x32_native(lo, hi), cm, nt);
    }
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    TO* crow = c + (row0 + i) * t.c_sm + col0 * t.c_sn;
    for (int64_t j = 0; j < cols; j += 16) {
      __m512 v = _mm512_add_ps(_mm512_loadu_ps(blk + i * ldb + j), _mm512_loadu_ps(bias + j));
      if (O == Dt::f32 && stream_f32x16(t, crow + j, cols - j)) {
        stream_ps512((float*)(crow + j), v);
      } else {
        put16_f32<O>(crow + j * t.c_sn, t.c_sn, v, cols - j);
      }
    }
  }
}

// The transpose of an fp32 block (blk[i][j] is C[row0 + j][col0 + i]; i < cols, j < rows).
template <Dt O>
void store_block_transposed(const Task& t, int64_t row0, int64_t col0, const float* blk, int64_t ldb,
                            int64_t rows, int64_t cols, const float* bias) {
  using TO = typename Ty<O>::T;
  TO* c = (TO*)t.c;
  // The usual case (bf16, a 17-32 column block): both 16 x 16 halves transposed first, so each
  // row of C gets one 64-byte store instead of two 32-byte ones at different times. Measured
  // here (2 threads, fwd, [G, N, K] weights, 30-40 rounds alternating in one process, medians):
  // G=8, M=4096, K=1024, N=2048 2-17% faster in 5 runs; Mixtral /4 2-3%; G=64 level.
  // A streamed output (Task::stream) takes non-temporal stores here too: forward, [G, N, K]
  // weights, 2 threads, 10-16 rounds alternating in one process, medians: G=8, M=16384, K=1024,
  // N=2048 (64 MiB out) 44.2-44.6 -> 40.1-40.3 ms; G=64, M=32768, K=N=512 14.2 -> 13.1-13.3 ms.
  if (O == Dt::bf16 && t.c_sn == 1 && cols > 16 && cols <= 32) {
    const __m512 b0 = _mm512_loadu_ps(bias), b1 = _mm512_loadu_ps(bias + 16);
    const __mmask32 cm = mask32(cols);
    const bool nt = stream_bf16_rows(t, (const uint16_t*)c, row0, col0, cols);
    for (int64_t j0 = 0; j0 < rows; j0 += 16) {
      __m512 lo[16], hi[16];
      for (int64_t i = 0; i < 16; ++i) {
        lo[i] = _mm512_loadu_ps(blk + i * ldb + j0);
        hi[i] = _mm512_loadu_ps(blk + (16 + i) * ldb + j0);
      }
      transpose16(lo);
      transpose16(hi);
      for (int64_t j = 0; j < imin(16, rows - j0); ++j) {
        put_bf16x32((uint16_t*)c + (row0 + j0 + j) * t.c_sm + col0,
                    f32_to_bf16x32_native(_mm512_add_ps(lo[j], b0), _mm512_add_ps(hi[j], b1)), cm, nt);
      }
    }
    return;
  }
  for (int64_t i0 = 0; i0 < cols; i0 += 16) {
    const __m512 bv = _mm512_loadu_ps(bias + i0);
    const __mmask16 cm = mask16(cols - i0);
    for (int64_t j0 = 0; j0 < rows; j0 += 16) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(blk + (i0 + i) * ldb + j0);
      transpose16(r);
      for (int64_t j = 0; j < imin(16, rows - j0); ++j) {
        __m512 v = _mm512_add_ps(r[j], bv);
        TO* crow = c + (row0 + j0 + j) * t.c_sm + (col0 + i0) * t.c_sn;
        if (O == Dt::bf16 && t.c_sn == 1) {
          masked_store_epi16x16((uint16_t*)crow, cm, f32_to_bf16x16_native(v));
        } else {
          put16_f32<O>(crow, t.c_sn, v, cols - i0);
        }
      }
    }
  }
}

// Bytes of B packed at a time (a column slice; see AmxScratch for the whole workspace).
constexpr int64_t kAmxWideBytes = 1024 * 1024;
// Prefetch distance of the swapped scheme, in 32-row blocks of W (1 and 2 measured alike here).
constexpr int64_t kAmxPrefetchBlocks = 2;
constexpr int64_t kAmxPanelK = 8;  // k step of amx_item_panels, in 32-wide tiles

int64_t amx_item_rows(int64_t K) {
  // Packed rows stay in L2 (2 MiB per core here): at most 512 KiB of them, 32..256 rows.
  const int64_t kp = round_up(imax(K, 1), 32);
  return imax(32, imin(kAmxBufRows, (512 * 1024 / (2 * kp)) / 32 * 32));
}

int64_t amx_workspace(int64_t K) {
  const int64_t kp = round_up(imax(K, 1), 32);
  return amx_item_rows(K) * kp * 2 + imax(kAmxWideBytes, 32 * kp * 2) + 32 * kAmxBufRows * 4 + 4 * 64;
}

// The three parts of an AMX item's workspace (amx_workspace bytes) for a problem with this K.
struct AmxScratch {
  uint16_t* rows;   // packed rows or VNNI columns of A: amx_item_rows(K) x Kp
  uint16_t* slice;  // packed columns of B: kAmxWideBytes, at least 32 x Kp
  float* sums;      // fp32 blocks: 32 x kAmxBufRows
  AmxScratch(void* ws, int64_t K) {
    const int64_t kp = round_up(imax(K, 1), 32);
    rows = (uint16_t*)ws;
    slice = rows + amx_item_rows(K) * kp;
    sums = (float*)(slice + imax(kAmxWideBytes / 2, 32 * kp));
  }
};

// Columns of B packed at a time (a multiple of 32, at most kAmxWideBytes of them, at least 32).
int64_t amx_slice_cols(int64_t cols, int64_t kp) {
  return imax(32, imin(round_up(cols, 32), (kAmxWideBytes / (2 * kp)) / 32 * 32));
}

// An item with more rows than fit packed in L2 (a large group): the right operand's columns are
// packed once per slice of `wide` columns (1 MiB, L2), and the rows stream through 32 at a time,
// each against every column block of the slice. So the expert's weights are packed once per
// call whatever the group's size, where the L2-resident scheme below packs or streams them once
// per 256 rows. Always the direct scheme (C = A @ VNNI(B)), k-contiguous W too, whose slice is
// then packed by 16 x 16 word transposes; A's rows are read as tiles in place where they can be
// (row-major, K a multiple of 32, a 16- or 32-row panel), else copied into 2 tiles x K (64 KiB
// at K = 1024). The swapped scheme here (W's rows copied as tiles, every 32-row panel of A
// packed into VNNI(A^T) once per slice, the sums transposed on the way out) measured slower on
// the Intel AMX VM (2026-12-03, 2 threads, one process alternating call by call, 64 MiB written
// between calls, 10-30 rounds, medians), swapped -> direct with A in place: G=8, M=4096, K=1024,
// N=2048 forward 7.59 -> 6.63, 7.79 -> 6.77 ms (Dirichlet sizes), 7.14 -> 6.66 ms (equal
// groups); M=16384 27.6 -> 25.4 ms; Mixtral /4 (G=8, M=1024, K=1024, N=3584) 4.35 / 4.31 / 4.42
// -> 4.09 / 4.09 / 4.14 ms; G=8, M=1024, K=720, N=1440 (A copied) 1.87 -> 1.80 ms; direct with
// A copied: G=8, M=4096 level (7.76 -> 7.83 ms). A in place in the input gradient (direct
// already): G=8, M=4096 7.99 -> 7.46, 7.82 -> 7.29 ms, equal groups 7.56 -> 7.19 ms, M=16384
// 27.6 -> 25.8 ms, Mixtral /4 5.61 -> 5.44 ms. G=64, M=2048, K=N=512 (few items this large):
// level. (A in place in amx_item too, for the input gradient's smaller items: 0-2% in three runs
// of 40 rounds, not kept.)
template <Dt O>
void amx_item_panels(const Task& t, const Item& it, void* ws) {
  const int64_t K = t.k, rows = it.m1 - it.m0, cols = it.n1 - it.n0;
  const int64_t ks = ceil_div(K, 32), kp = imax(ks * 32, 32);
  const AmxScratch scratch(ws, K);
  uint16_t* panel = scratch.rows;  // 2 tiles x ks: the current 32 rows
  uint16_t* blk = scratch.slice;
  float* cbuf = scratch.sums;
  alignas(64) float bias[32];
  const uint16_t* a = (const uint16_t*)t.a + it.m0 * t.a_sm;
  const uint16_t* b = (const uint16_t*)t.b;
  const bool a_in_place = t.a_sk == 1 && K % 32 == 0;
  const int64_t wide = amx_slice_cols(cols, kp);
  // The rows of A the panel after the one at r0 packs (the item's first 32 again after its last
  // when another slice follows) into L2, spread over the k steps of the panel's block calls, so
  // that the next pack (or, in place, the next panel's tile loads) reads them from L2 instead of
  // the L3 or memory (row-major or k-major A; other strides: none). The packs of A were 12% of a
  // G=8, M=4096, K=1024, N=2048 forward's time on an Intel AMX VM (2026-12-03, before the direct
  // scheme and A in place here; rdtsc per phase, 2 threads: per thread A packs 0.9 ms,
  // W slices 0.8, tiles 4.3, stores 1.05-1.6 of 8.4 ms); with this, the A packs took a third
  // less and the tiles ~6% more. In process, alternating, 2 threads, caches flushed, medians
  // of 20-60 rounds: that forward 8.73 -> 8.71, 9.01 -> 8.88 and 8.47 -> 8.19 ms, M=8192 16.90
  // -> 16.84 ms, input gradient level (8.44 -> 8.40, 8.93 -> 8.91 ms), G=8, M=8192, K=2048,
  // N=1024 input gradient 17.88 -> 17.09 ms, weight gradient level: small, never worse.
  auto next_panel = [&](int64_t r0, bool more_slices, int64_t calls) {
    const int64_t r1 = r0 + 32 < rows ? r0 + 32 : (more_slices ? 0 : rows);
    const int64_t n = imin(32, rows - r1);
    if (t.a_sk == 1) return PrefetchBlock(a, r1 * t.a_sm * 2, n, t.a_sm * 2, K * 2, calls);
    return PrefetchBlock(a, r1 * t.a_sm * 2, t.a_sm == 1 ? K : 0, t.a_sk * 2, n * 2, calls);
  };
  for (int64_t nw = 0; nw < cols; nw += wide) {
    const int64_t wc = imin(wide, cols - nw);
    pack_vnni_tiles(b + (it.n0 + nw) * t.b_sn, t.b_sk, t.b_sn, K, wc, blk);
    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
      const int64_t rr = imin(32, rows - r0);
      const int mt = rr > 16 ? 2 : 1;
      // The panel's two tiles: A's rows in place (`a_stride` bytes apart, 32 k per step), or
      // their copy (64 bytes apart, kTileElems per step).
      const bool in_place = a_in_place && (rr == 32 || rr == 16);
      if (!in_place) pack_rows_tiles(a + r0 * t.a_sm, t.a_sm, t.a_sk, rr, K, panel);
      const uint16_t* a0 = in_place ? a + r0 * t.a_sm : panel;
      const uint16_t* a1 = in_place ? a0 + 16 * t.a_sm : panel + ks * kTileElems;
      const int64_t a_stride = in_place ? t.a_sm * 2 : 64, a_step = in_place ? 32 : kTileElems;
      PrefetchBlock ahead = next_panel(r0, nw + wc < cols, ceil_div(wc, 32) * ceil_div(imax(ks, 1), kAmxPanelK));
      // Column blocks in chunks of 8 x 32 columns, k in steps of kAmxPanelK tiles, so the
      // panel's k step (2 tiles x kAmxPanelK, 16 KiB) stays in L1 for the chunk; the chunk's
      // 32 x 32 fp32 blocks (32 KiB) hold the sums between k steps. Measured here (2 threads,
      // bf16, 20-25 alternating rounds, medians) against whole-K blocks: Mixtral /4 (G=8, M=1024,
      // K=1024, N=3584) fwd 8.7 -> 7.7 ms, dgrad 10.6 -> 10.1 ms, wgrad 22.1 -> 20.3 ms; G=8,
      // M=4096, K=1024, N=2048 (1 thread) fwd 38.6 -> 36.7 ms, dgrad 38.0 -> 34.4 ms.
      const int64_t kc = kAmxPanelK;
      for (int64_t nc0 = 0; nc0 < wc; nc0 += 256) {
        const int64_t nce = imin(wc, nc0 + 256);
        for (int64_t s0 = 0; s0 < imax(ks, 1); s0 += kc) {  // k == 0: one pass of zero steps
          const int64_t kn = imin(kc, ks - s0);
          const uint16_t* p0 = a0 + s0 * a_step;
          const uint16_t* p1 = a1 + s0 * a_step;
          for (int64_t nb = nc0; nb < nce; nb += 32) {
            const int nt = nce - nb > 16 ? 2 : 1;
            const uint16_t* b0 = blk + ((nb / 16) * ks + s0) * kTileElems;
            const uint16_t* b1 = b0 + ks * kTileElems;
            float* c = cbuf + (nb - nc0) * 32;
            const AmxPrefetch pf = AmxPrefetch::spread(ahead.take(), kn);
            amx_dispatch(mt, nt, p0, p1, a_stride, a_step, b0, b1, kn, c, 32, pf, s0 > 0);
          }
        }
        for (int64_t nb = nc0; nb < nce; nb += 32) {
          const int64_t nc = imin(32, wc - nb);
          const float* c = cbuf + (nb - nc0) * 32;
          load_bias<Dt::bf16>(t, it.n0 + nw + nb, nc, bias, 32);
          store_block<O>(t, it.m0 + r0, it.n0 + nw + nb, c, 32, rr, nc, bias);
        }
      }
    }
  }
}

template <Dt O>
void amx_item(const Task& t, const Item& it, void* ws) {
  const int64_t K = t.k, rows = it.m1 - it.m0, cols = it.n1 - it.n0;
  // A streamed output (Task::stream) outside the swapped scheme takes amx_item_panels too: it
  // writes rows 32 at a time in memory order, where the scheme below writes a 32-column strip of
  // all the item's rows at a time (G=64, M=2048, K=N=512 bf16 weight gradient 3.8-4.6 -> 3.3 ms,
  // G=256 level; see grouped_mm.cpp).
  const bool swapped = t.b_sk == 1 && t.b_sn != 1;
  if (swapped && t.m <= kGemvRows && K >= kGemvAmxMinK) {
    gemv_item<Dt::bf16, O>(t, it, ws);
    return;
  }
  if (gemvt_task(t, false)) {
    gemvt_item<Dt::bf16, O>(t, it, ws);
    return;
  }
  if (rows > amx_item_rows(K) || (t.stream && !swapped)) {
    amx_item_panels<O>(t, it, ws);
    return;
  }
  const int64_t ks = ceil_div(K, 32), kp = imax(ks * 32, 32), mts = ceil_div(rows, 16);
  const AmxScratch scratch(ws, K);
  uint16_t* big = scratch.rows;  // fits: larger items took amx_item_panels
  uint16_t* blk = scratch.slice;
  float* cbuf = scratch.sums;
  alignas(64) float bias[32];
  const uint16_t* a = (const uint16_t*)t.a + it.m0 * t.a_sm;
  const uint16_t* b = (const uint16_t*)t.b;
  if (!swapped) {
    // C[rows, cols] = A tiles @ VNNI(B). B is packed `wide` columns at a time (all of them for
    // K <= 512), reading its rows in memory order; then each 32-column block runs all rows.
    pack_rows_tiles(a, t.a_sm, t.a_sk, rows, K, big);
    const int64_t wide = amx_slice_cols(cols, kp);
    for (int64_t nw = 0; nw < cols; nw += wide) {
      const int64_t wc = imin(wide, cols - nw);
      pack_vnni_tiles(b + (it.n0 + nw) * t.b_sn, t.b_sk, t.b_sn, K, wc, blk);
      for (int64_t nb = 0; nb < wc; nb += 32) {
        const int64_t nc = imin(32, wc - nb);
        const int nt = nc > 16 ? 2 : 1;
        const uint16_t* bt = blk + (nb / 16) * ks * kTileElems;
        for (int64_t mt = 0; mt < mts; mt += 2) {
          const int m2 = mts - mt >= 2 ? 2 : 1;
          amx_dispatch(m2, nt, big + mt * ks * kTileElems, big + (mt + 1) * ks * kTileElems, 64, kTileElems,
                       bt, bt + ks * kTileElems, ks, cbuf + mt * 16 * 32, 32);
        }
        load_bias<Dt::bf16>(t, it.n0 + nw + nb, nc, bias, 32);
        store_block<O>(t, it.m0, it.n0 + nw + nb, cbuf, 32, rows, nc, bias);
      }
    }
  } else {
    // C^T[32-row block of B^T, rows] = B^T rows (straight from memory) @ VNNI(A^T). While a
    // block computes, the rows of the next block are prefetched: each row of W is read once, as
    // a stream of 64-byte pieces, and without the prefetch every tile load waited on memory.
    pack_vnni_tiles(a, t.a_sk, t.a_sm, K, rows, big);
    const int64_t ldc = mts * 16;
    for (int64_t nb = 0; nb < cols; nb += 32) {
      const int64_t nr = imin(32, cols - nb);
      const int nt = nr > 16 ? 2 : 1;
      const uint16_t* w = b + (it.n0 + nb) * t.b_sn;
      const uint16_t *w0, *w1;
      int64_t w_stride, w_step;
      // Tiles straight from W: copying each block first (a sequential read, then tile loads from
      // the copy) measured 12-16 ms against 7-9 ms here (1 thread, G=256, M=4096, K=512, N=256).
      if (nr % 16 == 0 && K % 32 == 0) {
        w0 = w;
        w1 = w + 16 * t.b_sn;
        w_stride = t.b_sn * 2;
        w_step = 32;
      } else {  // a partial tile of rows or of k: copy it, zero-padded (never read past B)
        pack_rows_tiles(w, t.b_sn, t.b_sk, nr, K, blk);
        w0 = blk;
        w1 = blk + ks * kTileElems;
        w_stride = 64;
        w_step = kTileElems;
      }
      // Rows `ahead` further on, also past this item's columns: with [G, N, K] weights stored
      // contiguously those are the next group's, which this thread usually takes next (see
      // run_items). A prefetch never faults, so past the end of W it costs only the instruction.
      // When W's rows are back to back ([G, N, K] contiguous), those 32 rows are one run of
      // 32 x K bf16, prefetched in memory order (32 lines a k-step, ks k-steps: all of it);
      // otherwise the next 64 bytes of each of the 32 rows. Measured here (2 threads, fwd,
      // 20 rounds alternating in one process, medians), memory order against 64 bytes of each
      // row: G=256, M=4096, K=512, N=256 3-10% faster, G=64, M=2048, K=N=512 1-9% faster, in
      // 12 of 12 runs (weights warm in L3, or after 256 MB written, or after a call of
      // torch._grouped_mm in between).
      AmxPrefetch pf;
      if (w_step == 32) {
        pf.p = (const char*)((uintptr_t)w + 32 * kAmxPrefetchBlocks * t.b_sn * 2);
        pf.lines = 32;
        pf.stride = t.b_sn == K ? 64 : w_stride;
        pf.step = t.b_sn == K ? 32 * 64 : 64;
      }
      for (int64_t mt = 0; mt < mts; mt += 2) {
        const int m2 = mts - mt >= 2 ? 2 : 1;
        amx_dispatch(nt, m2, w0, w1, w_stride, w_step, big + mt * ks * kTileElems, big + (mt + 1) * ks * kTileElems,
                     ks, cbuf + mt * 16, ldc, mt == 0 ? pf : AmxPrefetch{});
      }
      load_bias<Dt::bf16>(t, it.n0 + nb, nr, bias, 32);
      store_block_transposed<O>(t, it.m0, it.n0 + nb, cbuf, ldc, rows, nr, bias);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 FMA: a C block of R <= 6 rows x 4 vectors (64 fp32 or 32 fp64 columns) in registers,
// over k blocks of kKC so that the packed block of B (kKC x 4 vectors, 32 KiB) stays in L1.
// Both operands are packed, converted to the accumulation type: A's rows once per item, B's
// block once per (column block, k block) and then used by all rows of the item.
// Measured here (1 thread, G=64, M=2048, K=N=512, fp32, same weights in every group so the
// kernel is timed rather than memory): reading B's rows or A's rows in place instead of packing
// them was 1.6-1.8x slower (rows 2 KiB apart fall into a few L1 sets).

constexpr int64_t kMR = 6;
constexpr int64_t kKC = 128;

struct VF {
  using V = __m512;
  using S = float;
  static constexpr int64_t L = 16;
  static constexpr bool kPairs = false;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const S* p) { return _mm512_load_ps(p); }
  static void store(S* p, V v) { _mm512_store_ps(p, v); }
  static V bcast(const S* p) { return _mm512_set1_ps(*p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};
struct VD {
  using V = __m512d;
  using S = double;
  static constexpr int64_t L = 8;
  static constexpr bool kPairs = false;
  static V zero() { return _mm512_setzero_pd(); }
  static V load(const S* p) { return _mm512_load_pd(p); }
  static void store(S* p, V v) { _mm512_store_pd(p, v); }
  static V bcast(const S* p) { return _mm512_set1_pd(*p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
};
// bf16 for AVX512-BF16 (Isa::avx512bf16): each packed element S is the bits of two bf16 of
// consecutive k (the even k in the low half), and "fma" is VDPBF16PS, which adds both products
// (exact in fp32) to the fp32 accumulator, rounding to nearest even, with denormal inputs and
// outputs taken as zero (as AMX does). Twice the multiply-adds of fp32 FMA per instruction, and
// half the packed bytes. Measured on a 2-core AMD EPYC (Zen 4) VM (2026-11-30, 2 threads, 10
// rounds in one process, medians, group sizes drawn anew per call), against VF on the converted
// values: G=64, M=2048, K=N=512 forward / input gradient / weight gradient 6.36 / 6.46 / 6.70 ->
// 4.09 / 4.42 / 3.92 ms, G=256, M=4096, K=512, N=256 7.78 / 7.73 / 8.09 -> 5.58 / 5.71 / 4.70 ms
// (one dense torch.mm of the same size, oneDNN: 2.8-3.9 ms).
// VF's loads, stores and broadcasts move the pairs' bits (S = float: never computed with).
struct VB : VF {
  static constexpr bool kPairs = true;
  static V fma(V a, V b, V c) { return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b); }
};

template <bool B>
struct Bool {
  static constexpr bool value = B;
};

// Element (i, k) of packed A, row-major (a[i*lda + k]) or, with KM, k-major (a[k*lda + i]; see
// kmajor_ldk).
template <bool KM, typename S>
inline const S* a_at(const S* a, int64_t lda, int i, int64_t k) {
  return KM ? a + k * lda + i : a + i * lda + k;
}

// acc[i][j] += sum_{k < kc} A(i, k) * b[k][j*L .. +L) for i < R (b: kc rows of 4 vectors), A(i, k)
// at a_at<KM>(a, lda, i, k).
// Each k step also prefetches into L2 the lines k, k + kc, ... below pf_lines of pf, pf + 64, ...
template <class VT, int R, bool KM>
inline void fma_kernel(const typename VT::S* a, int64_t lda, const typename VT::S* b, int64_t kc,
                       typename VT::V (&acc)[kMR][4], const char* pf, int64_t pf_lines) {
  using V = typename VT::V;
  constexpr int64_t NR = 4 * VT::L;
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t l = k; l < pf_lines; l += kc) _mm_prefetch(pf + l * 64, _MM_HINT_T1);
    const V b0 = VT::load(b + k * NR), b1 = VT::load(b + k * NR + VT::L), b2 = VT::load(b + k * NR + 2 * VT::L),
            b3 = VT::load(b + k * NR + 3 * VT::L);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const V av = VT::bcast(a_at<KM>(a, lda, i, k));
      acc[i][0] = VT::fma(av, b0, acc[i][0]);
      acc[i][1] = VT::fma(av, b1, acc[i][1]);
      acc[i][2] = VT::fma(av, b2, acc[i][2]);
      acc[i][3] = VT::fma(av, b3, acc[i][3]);
    }
  }
}

// A VB panel of n-contiguous B (64 columns, one k slab) in the column order of pair_unpack,
// built by the first row block of the panel from B's rows as it multiplies, and stored for the
// row blocks after it (`keep`; nullptr where there are none). Each k step reads 32 columns of
// rows 2p and 2p + 1 in memory order and interleaves them with one VPUNPCKLWD and one
// VPUNPCKHWD, which work within 128-bit lanes, so that the first word vector holds columns 0-3,
// 8-11, 16-19, 24-27 and the second 4-7, 12-15, 20-23, 28-31 (fma_rows restores the order once
// per output row piece). Until 2026-12-01 a packing pass built the whole slab before the first
// block (perf, one thread, G=256 input gradient with the weights in cache: 19% of the kernel's
// samples); now that work runs beside the first block's VDPBF16PS. Measured on the Zen 4 VM
// (bf16 input gradient, [G, K, N] weights, 2 threads, one process alternating, caches flushed,
// 10-12 rounds, medians), pass -> here: G=256, M=4096, K=512, N=256 4.65 -> 4.38 ms (Dirichlet
// sizes), 4.64 -> 4.12 ms (equal groups of 16 rows), 4.53 -> 4.27 ms (x1.62 -> x1.53); G=64,
// M=2048, K=N=512 3.85 -> 3.69, 3.74 -> 3.60 (groups of 32), 4.00 -> 3.88 ms; G=8, M=4096,
// K=1024, N=2048 44.7 -> 43.7 ms; the model shapes 3-9% faster (Qwen3-30B-A3B /4 3.07 -> 2.80
// ms, DeepSeek-V3 /16 2.52 -> 2.30 ms); weight gradients level (G=8, whose K of a group's ~512
// rows takes this path too).
// fp32 B (VF) takes the same route, its panels being plain copies of 64 columns of its rows
// (fma_pack_b_rows' layout); measured the same way, pass -> here: G=256 input gradient 9.14 ->
// 8.75 ms (Dirichlet), 9.49 -> 9.00 ms (groups of 16), 8.81 -> 8.28 ms; G=64 7.69 -> 7.53, 7.13 ->
// 6.74 (groups of 32), 7.47 -> 7.22 ms; Qwen3-30B-A3B /4 5.46 -> 5.19 ms, DeepSeek-V3 /16 4.26 ->
// 4.07 ms; G=8 (MKL's path) and the weight gradients level.
struct RawPanel {
  const void* lo;  // row k of the slab's first k (pair), at the panel's first column
  int64_t sk;      // elements between rows of B
  int64_t k_left;  // rows of B from lo to the end of K
  int64_t cols;    // columns of the panel that exist, 1-64
  float* keep;
};

// The k loop of a RawPanel: build(k, b) makes step k's four vectors, which are kept for the later
// row blocks and multiplied with the R rows of A.
//
// build also prefetches into L1 the panel's lines of B kRawAheadSteps steps ahead (bf16: 16 rows,
// fp32: 8): the slab's prefetch window brings them into L2 only, and the block read them from
// there one step ahead at most (perf, one thread, bf16 input gradient with the weights in L2: the
// samples on the instructions after its loads of B). Measured on the Zen 5 VM (input gradient,
// [G, K, N] weights, 2 threads, one process alternating, caches flushed, Dirichlet sizes, 12-20
// rounds, medians, ratio to dense, 2026-12-01), none -> 8 steps: bf16 G=8, M=4096, K=1024, N=2048
// x1.07 / x1.16 -> x0.95 / x1.04; G=64, M=2048, K=N=512 x1.97 / x1.87 -> x1.42 / x1.49; G=256,
// M=4096, K=512, N=256 x2.21 / x2.34 -> x1.79 / x1.99; fp32 G=64 6.17 -> 4.95 ms, G=256 7.19 ->
// 6.02 ms, G=8 level; bf16 weight gradient G=8 x1.01 -> x0.95, G=64 / G=256 level. 4, 6, 12 and
// 16 steps measured within a few percent of 8.
constexpr int64_t kRawAheadSteps = 8;
template <class VT, int R, bool KM, class Build>
inline void raw_kernel(const float* a, int64_t lda, const RawPanel& raw, int64_t kc, __m512 (&acc)[kMR][4],
                       const char* pf, int64_t pf_lines, const Build& build) {
  float* const keep = raw.keep;  // (locals: the stores below would make GCC reload raw's fields)
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t l = k; l < pf_lines; l += kc) _mm_prefetch(pf + l * 64, _MM_HINT_T1);
    __m512 b[4];
    build(k, b);
    if (keep) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) _mm512_store_ps(keep + k * 64 + j * 16, b[j]);
    }
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m512 av = VT::bcast(a_at<KM>(a, lda, i, k));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[i][j] = VT::fma(av, b[j], acc[i][j]);
    }
  }
}

// bf16 pairs: rows 2k and 2k + 1 of the slab, interleaved.
template <int R, bool KM>
inline void vb_raw_kernel(const float* a, int64_t lda, const RawPanel& raw, int64_t kc, __m512 (&acc)[kMR][4],
                          const char* pf, int64_t pf_lines) {
  const __mmask32 m0 = mask32(raw.cols), m1 = raw.cols > 32 ? mask32(raw.cols - 32) : 0;
  const uint16_t* const lo = (const uint16_t*)raw.lo;
  const int64_t sk = raw.sk, k_left = raw.k_left;
  raw_kernel<VB, R, KM>(a, lda, raw, kc, acc, pf, pf_lines, [=](int64_t k, __m512 (&b)[4]) {
    const uint16_t* r = lo + 2 * k * sk;
    const char* ahead = (const char*)(r + 2 * kRawAheadSteps * sk);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 2 * sk, _MM_HINT_T0);
    _mm_prefetch(ahead + 2 * sk + 64, _MM_HINT_T0);
    const __m512i l0 = masked_load_epi16x32(m0, r), l1 = masked_load_epi16x32(m1, r + 32);
    __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
    if (2 * k + 1 < k_left) {  // (the last row of an odd K has no pair)
      h0 = masked_load_epi16x32(m0, r + sk);
      h1 = masked_load_epi16x32(m1, r + sk + 32);
    }
    b[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(l0, h0));
    b[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(l0, h0));
    b[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(l1, h1));
    b[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(l1, h1));
  });
}

// fp32: row k of the slab.
template <int R, bool KM>
inline void vf_raw_kernel(const float* a, int64_t lda, const RawPanel& raw, int64_t kc, __m512 (&acc)[kMR][4],
                          const char* pf, int64_t pf_lines) {
  __mmask16 m[4];
  for (int j = 0; j < 4; ++j) m[j] = raw.cols > 16 * j ? mask16(raw.cols - 16 * j) : 0;
  const float* const lo = (const float*)raw.lo;
  const int64_t sk = raw.sk;
  raw_kernel<VF, R, KM>(a, lda, raw, kc, acc, pf, pf_lines, [&m, lo, sk](int64_t k, __m512 (&b)[4]) {
    const float* r = lo + k * sk;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm_prefetch((const char*)(r + kRawAheadSteps * sk + 16 * j), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) b[j] = masked_load_ps(m[j], r + 16 * j);
  });
}

// Row stride of packed A: K rounded up to a vector, plus one cache line so that consecutive
// rows do not share L1 sets.
template <typename S>
int64_t fma_lda(int64_t K) {
  constexpr int64_t per_line = 64 / sizeof(S);
  return round_up(imax(K, 1), per_line) + per_line;
}

// `rows` rows of `lanes` 32-bit lanes, lda apart, from a source whose lanes run along its rows
// (a column-major A, or a k-contiguous B whose k becomes the packed rows): for 16 rows at a time,
// column(l, r0, rm) gives lane l of rows r0 .. r0 + 15 (rm of them) as one vector, and 16 such
// vectors are transposed in registers.
template <class Column>
void pack_columns_transposed(int64_t rows, int64_t lanes, float* dst, int64_t lda, const Column& column) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const __mmask16 rm = mask16(rows - r0);
    for (int64_t l0 = 0; l0 < lanes; l0 += 16) {
      __m512 v[16];
      for (int64_t x = 0; x < 16; ++x) v[x] = l0 + x < lanes ? column(l0 + x, r0, rm) : _mm512_setzero_ps();
      transpose16(v);
      for (int64_t x = 0; x < imin(16, rows - r0); ++x) masked_store_ps(dst + (r0 + x) * lda + l0, mask16(lanes - l0), v[x]);
    }
  }
}

// Rows [m0, m1) of A into [rows rounded up to 6][lda] in the accumulation type (zero rows after).
template <Dt D, typename S>
void fma_pack_a(const Task& t, const Item& it, S* dst, int64_t lda) {
  using T = typename Ty<D>::T;
  const int64_t rows = it.m1 - it.m0, K = t.k;
  const T* a = (const T*)t.a + it.m0 * t.a_sm;
  constexpr bool f32_lanes = sizeof(S) == 4;  // the vector paths (fp64 takes the scalar one)
  if constexpr (f32_lanes) {
    if (t.a_sm == 1 && t.a_sk != 1) {
      // Column-major A (x^T in the weight gradient).
      pack_columns_transposed(rows, K, (float*)dst, lda, [&](int64_t k, int64_t r0, __mmask16 rm) {
        return load16_f32<D>(a + k * t.a_sk + r0, rm);
      });
      for (int64_t r = rows; r < round_up(rows, kMR); ++r) memset(dst + r * lda, 0, K * sizeof(S));
      return;
    }
  }
  for (int64_t r = 0; r < round_up(rows, kMR); ++r) {
    S* d = dst + r * lda;
    if (r >= rows) {
      memset(d, 0, K * sizeof(S));
      continue;
    }
    if constexpr (f32_lanes) {
      if (t.a_sk == 1) {
        for (int64_t k = 0; k < K; k += 16) {
          masked_store_ps((float*)d + k, mask16(K - k), load16_f32<D>(a + r * t.a_sm + k, mask16(K - k)));
        }
        continue;
      }
    }
    for (int64_t k = 0; k < K; ++k) d[k] = (S)Ty<D>::get(a + r * t.a_sm + k * t.a_sk);
  }
}

// B[k0 : k0 + kc, n0 : n0 + nc] into [kc][64] fp32, zero-padded columns. For B without contiguous
// rows: fma_item packs those with fma_pack_b_rows.
template <Dt D>
void fma_pack_b(const Task& t, int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst) {
  using T = typename Ty<D>::T;
  const T* b = (const T*)t.b + k0 * t.b_sk + n0 * t.b_sn;
  if (t.b_sk == 1) {
    // k-contiguous (transposed weights): 16 columns x 16 k at a time, transposed in registers.
    pack_columns_transposed(kc, 64, dst, 64, [&](int64_t j, int64_t kk, __mmask16 km) {
      return j < nc ? load16_f32<D>(b + j * t.b_sn + kk, km) : _mm512_setzero_ps();
    });
  } else {
    for (int64_t k = 0; k < kc; ++k) {
      for (int64_t j = 0; j < 64; ++j) dst[k * 64 + j] = j < nc ? Ty<D>::get(b + k * t.b_sk + j * t.b_sn) : 0.0f;
    }
  }
}

// fp64 into [kc][32] (B without contiguous rows, as fma_pack_b).
void fma_pack_b_f64(const Task& t, int64_t k0, int64_t kc, int64_t n0, int64_t nc, double* dst) {
  const double* b = (const double*)t.b + k0 * t.b_sk + n0 * t.b_sn;
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t j = 0; j < 32; ++j) dst[k * 32 + j] = j < nc ? b[k * t.b_sk + j * t.b_sn] : 0.0;
  }
}

// B[k0 : k0 + kc, n0 : n0 + wc] with contiguous rows into 64-column panels [wc / 64][kc][64]:
// row by row, so the source is read in memory order.
template <Dt D>
void fma_pack_b_rows(const Task& t, int64_t k0, int64_t kc, int64_t n0, int64_t wc, float* dst) {
  using T = typename Ty<D>::T;
  const int64_t nsub = ceil_div(wc, 64);
  for (int64_t k = 0; k < kc; ++k) {
    const T* row = (const T*)t.b + (k0 + k) * t.b_sk + n0;
    for (int64_t sb = 0; sb < nsub; ++sb) {
      float* d = dst + (sb * kc + k) * 64;
      for (int64_t j = 0; j < 64; j += 16) {
        const int64_t c = sb * 64 + j;
        _mm512_store_ps(d + j, c < wc ? load16_f32<D>(row + c, mask16(wc - c)) : _mm512_setzero_ps());
      }
    }
  }
}

template <Dt D>
void fma_pack_b_rows(const Task& t, int64_t k0, int64_t kc, int64_t n0, int64_t wc, double* dst) {
  const int64_t nsub = ceil_div(wc, 32);
  for (int64_t k = 0; k < kc; ++k) {
    const double* row = (const double*)t.b + (k0 + k) * t.b_sk + n0;
    for (int64_t sb = 0; sb < nsub; ++sb) {
      double* d = dst + (sb * kc + k) * 32;
      for (int64_t j = 0; j < 32; j += 8) {
        const int64_t c = sb * 32 + j;
        _mm512_store_pd(d + j, c < wc ? masked_load_pd(mask8(wc - c), row + c) : _mm512_setzero_pd());
      }
    }
  }
}

template <Dt D>
inline void fma_pack_b_into(const Task& t, int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* d) {
  fma_pack_b<D>(t, k0, kc, n0, nc, d);
}
template <Dt D>
inline void fma_pack_b_into(const Task& t, int64_t k0, int64_t kc, int64_t n0, int64_t nc, double* d) {
  fma_pack_b_f64(t, k0, kc, n0, nc, d);
}

// Packing for VB: bf16 pairs of consecutive k as 32-bit words, zero past K (an odd K ends in a
// pair with a zero high half) and in padding rows and columns.

// Words of two rows k, k + 1 of 16 elements each (contiguous, `m` of them valid): the pair of
// every element; row k + 1 absent (past K) when `has_hi` is false.
inline __m512i pair_words(const uint16_t* lo, const uint16_t* hi, bool has_hi, __mmask16 m) {
  const __m512i l = _mm512_cvtepu16_epi32(masked_load_epi16x16(m, lo));
  if (!has_hi) return l;
  return _mm512_or_si512(l, _mm512_slli_epi32(_mm512_cvtepu16_epi32(masked_load_epi16x16(m, hi)), 16));
}

// Rows [m0, m1) of A into [rows rounded up to kMR][lda] words, word p the pair k = 2p, 2p + 1.
void pair_pack_a(const Task& t, const Item& it, float* dst, int64_t lda) {
  const int64_t rows = it.m1 - it.m0, K = t.k, KU = ceil_div(K, 2);
  const uint16_t* a = (const uint16_t*)t.a + it.m0 * t.a_sm;
  for (int64_t r = rows; r < round_up(rows, kMR); ++r) memset(dst + r * lda, 0, KU * 4);
  if (t.a_sm == 1 && t.a_sk != 1) {
    // Column-major A (x^T in the weight gradient): the pairs of a column from two k rows.
    pack_columns_transposed(rows, KU, dst, lda, [&](int64_t p, int64_t r0, __mmask16 rm) {
      const int64_t k = 2 * p;
      return _mm512_castsi512_ps(pair_words(a + k * t.a_sk + r0, a + (k + 1) * t.a_sk + r0, k + 1 < K, rm));
    });
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* d = (uint16_t*)(dst + r * lda);
    const uint16_t* src = a + r * t.a_sm;
    if (t.a_sk == 1) {
      for (int64_t k = 0; k < K; k += 32) masked_store_epi16x32(d + k, mask32(K - k), masked_load_epi16x32(mask32(K - k), src + k));
    } else {
      for (int64_t k = 0; k < K; ++k) d[k] = src[k * t.a_sk];
    }
    if (K & 1) d[K] = 0;
  }
}

// Column-major A (a_sm == 1: x^T in the weight gradient), rows [m0, m1), k-major (see
// kmajor_ldk): dst[k * ldk + r] (Pairs: dst[p * ldk + r], the words of k = 2p and 2p + 1), zero
// in the rows past the item's up to ldk. A copy in memory order where the row-major layout
// needs 16 x 16 transposes.
template <Dt D, bool Pairs>
void pack_a_kmajor(const Task& t, const Item& it, float* dst, int64_t ldk) {
  using T = typename Ty<D>::T;
  const int64_t rows = it.m1 - it.m0, K = t.k, KU = Pairs ? ceil_div(K, 2) : K;
  const T* a = (const T*)t.a + it.m0;
  for (int64_t p = 0; p < KU; ++p) {
    float* d = dst + p * ldk;
    for (int64_t r0 = 0; r0 < ldk; r0 += 16) {
      const __mmask16 rm = r0 < rows ? mask16(rows - r0) : 0;
      if constexpr (Pairs) {
        const int64_t k = 2 * p;
        _mm512_store_ps(d + r0, _mm512_castsi512_ps(pair_words((const uint16_t*)a + k * t.a_sk + r0,
                                                               (const uint16_t*)a + (k + 1) * t.a_sk + r0, k + 1 < K, rm)));
      } else {
        _mm512_store_ps(d + r0, load16_f32<D>(a + p * t.a_sk + r0, rm));
      }
    }
  }
}

// Pairs [p0, p0 + pc) of columns [n0, n0 + nc) of B into [pc][64] words (zero columns past nc).
// For B without contiguous rows: fma_item packs those with pair_pack_b_rows.
void pair_pack_b(const Task& t, int64_t p0, int64_t pc, int64_t n0, int64_t nc, float* dst) {
  const int64_t K = t.k;
  const uint16_t* b = (const uint16_t*)t.b + n0 * t.b_sn;
  if (t.b_sk == 1) {
    // k-contiguous (transposed weights): a pair is one word of a column, so 16 columns x 16
    // pairs are one 16 x 16 transpose of words.
    pack_columns_transposed(pc, 64, dst, 64, [&](int64_t j, int64_t pp, __mmask16) {
      const int64_t k = 2 * (p0 + pp);
      return j < nc ? _mm512_castsi512_ps(masked_load_epi16x32(mask32(K - k), b + j * t.b_sn + k)) : _mm512_setzero_ps();
    });
  } else {
    uint32_t* d = (uint32_t*)dst;
    for (int64_t p = 0; p < pc; ++p) {
      const int64_t k = 2 * (p0 + p);
      for (int64_t j = 0; j < 64; ++j) {
        const uint32_t lo = j < nc ? b[k * t.b_sk + j * t.b_sn] : 0;
        const uint32_t hi = j < nc && k + 1 < K ? b[(k + 1) * t.b_sk + j * t.b_sn] : 0;
        d[p * 64 + j] = lo | hi << 16;
      }
    }
  }
}

// Measured on the Zen 4 VM (2 threads, bf16 input gradient, [G, K, N] weights, the two packings
// alternating call by call in one process, 20 rounds, medians, ratio to one dense torch.mm):
// G=64, M=2048, K=N=512 x1.17 -> x1.08 with one weight matrix shared by all groups (the compute
// alone), x1.48 -> x1.43 with distinct ones and the caches flushed between calls; G=256, M=4096,
// K=512, N=256 x1.32 -> x1.29 and x1.88 -> x1.81. In the weight gradient (B = the output
// gradient, K = a group's rows) G=8, M=4096, K=1024, N=2048 x1.17 -> x1.07-1.11; G=64 / G=256,
// groups of ~32 / ~16 rows, level or 1-3% slower, as the order is restored per output row after
// only K / 2 steps: hence kPermMinK. (VPERMT2W, which interleaves in column order directly, made
// the G=256 forward 8-15% slower.)
constexpr int64_t kPermMinK = 128;

// The accumulators of a RawPanel (pair_unpack order) back in column order, 32 columns at a time.
inline void pair_unpack(__m512& v0, __m512& v1) {
  // natural column c of 32: 128-bit lane c / 8 of the source, word c % 8 < 4 from v0, else v1
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 a = _mm512_permutex2var_ps(v0, lo, v1), b = _mm512_permutex2var_ps(v0, hi, v1);
  v0 = a;
  v1 = b;
}

void pair_pack_b_rows(const Task& t, int64_t p0, int64_t pc, int64_t n0, int64_t wc, float* dst) {
  const int64_t nsub = ceil_div(wc, 64), K = t.k;
  for (int64_t p = 0; p < pc; ++p) {
    const int64_t k = 2 * (p0 + p);
    const uint16_t* lo = (const uint16_t*)t.b + k * t.b_sk + n0;
    for (int64_t sb = 0; sb < nsub; ++sb) {
      float* d = dst + (sb * pc + p) * 64;
      for (int64_t j = 0; j < 64; j += 16) {
        const int64_t c = sb * 64 + j;
        const __m512i w = c < wc ? pair_words(lo + c, lo + t.b_sk + c, k + 1 < K, mask16(wc - c)) : _mm512_setzero_si512();
        _mm512_store_si512(d + j, w);
      }
    }
  }
}

// Rows [row0, row0 + R) of C from registers: + bias, one rounding to O. The column loop has a
// constant trip count and is unrolled, so that acc stays in registers: with `j < 4 && j * 16 <
// nc` as its condition GCC kept 15 of the 24 accumulators on the stack, and the weight gradient
// (K of ~32 per group, so a store per 32 k steps) took 14-17% longer (compute only, 2 threads).
// kNativeBf16: bf16 output rounded with the AVX512-BF16 conversion (the VB kernel's CPUs have it),
// 32 columns (one line) per store, non-temporal for a Task::stream output where the line is
// whole and aligned: ordinary stores read every line of C before writing it. Measured on the
// Zen 4 VM (2 threads, weight gradient, output from the cache, 48 MiB written between calls,
// 20-30 rounds alternating in one process, medians, 2026-11-30): G=64, M=2048, K=N=512 4.79 ->
// 4.02 and 5.89 -> 4.33 ms, G=256, M=4096, K=512, N=256 6.70 -> 5.12 and 7.11 -> 5.29 ms, G=8,
// M=4096, K=1024, N=2048 46.6 -> 45.5 ms; input gradient G=8 (8 MiB out) 1-2% faster.
//
// A block of all 64 columns of n-contiguous C (fp32, or bf16 with the native conversion) takes
// fma_store_full: the decisions taken once per block (streamed or not, no masks) and C's pointer
// and stride in locals. Below, per 32- or 16-column piece, each store re-tested alignment, built
// a mask and (the stores may alias the Task) reloaded t's fields: at a weight gradient's K of 16
// (8 pairs of k per block, 192 VDPBF16PS) that made a block 102 ns against 59 ns without any
// epilogue (one thread, G=64 groups of 16 tokens, K=512, N=256, inputs in cache); a standalone
// copy of the loop with the full epilogue took 64 ns. Measured on the Zen 4 VM (2 threads, one
// process alternating, caches flushed, Dirichlet sizes, 10 rounds, medians, 2026-12-01), before
// -> after, bf16 weight gradient: G=256, M=4096, K=512, N=256 4.26 -> 3.74 ms (dense 3.02), G=64,
// M=2048, K=N=512 3.45 -> 3.16, Qwen3-30B-A3B /4 2.95 -> 2.69-2.78, DeepSeek-V3 /16 2.22 -> 1.92,
// G=8 level; equal groups of 16 tokens at G=256 4.37 -> 3.53-3.57; input gradients 0-2%.
// Without a bias the sums are stored as they are, where adding the zeros load_bias wrote took
// 24 VADDPS a block of 6 rows: at a weight gradient's 16 tokens a group that was ~2% of the call
// (Zen 4 VM, 2 threads, one process alternating, caches flushed, 16-24 rounds, medians,
// 2026-12-07: G=256, M=4096, K=512, N=256 4.05 -> 3.96 ms with Dirichlet sizes, 3.95 -> 3.85 and
// 3.95 -> 3.82 ms with groups of 16; G=64 weight gradients and the input gradients level). Adding
// +0 changed no sum but -0, which VDPBF16PS leaves where it flushes a negative denormal result to
// zero: here such sums are now -0 as the reference's are (checked: 16 tokens of 2^-70 x -2^-70);
// the other epilogues still add the zeros (+0 there).
template <Dt O, int R>
inline void fma_store_full(const Task& t, int64_t row0, int64_t col0, __m512 (&acc)[kMR][4], const float* bias) {
  using TO = typename Ty<O>::T;
  TO* const c0 = (TO*)t.c + row0 * t.c_sm + col0;
  const int64_t ldc = t.c_sm;
  const __m512 b0 = _mm512_load_ps(bias), b1 = _mm512_load_ps(bias + 16), b2 = _mm512_load_ps(bias + 32),
               b3 = _mm512_load_ps(bias + 48);
  auto rows = [&](auto nt, auto with_bias) {
    constexpr bool kNt = decltype(nt)::value, kBias = decltype(with_bias)::value;
    auto plus = [&](__m512 v, __m512 b) { return kBias ? _mm512_add_ps(v, b) : v; };
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m512 v0 = plus(acc[i][0], b0), v1 = plus(acc[i][1], b1), v2 = plus(acc[i][2], b2),
                   v3 = plus(acc[i][3], b3);
      TO* const p = c0 + i * ldc;
      if constexpr (O == Dt::bf16) {
        const __m512i lo = f32_to_bf16x32_native(v0, v1), hi = f32_to_bf16x32_native(v2, v3);
        if constexpr (kNt) {
          stream_si512(p, lo);
          stream_si512(p + 32, hi);
        } else {
          _mm512_storeu_si512(p, lo);
          _mm512_storeu_si512(p + 32, hi);
        }
      } else if constexpr (kNt) {
        stream_ps512(p, v0);
        stream_ps512(p + 16, v1);
        stream_ps512(p + 32, v2);
        stream_ps512(p + 48, v3);
      } else {
        _mm512_storeu_ps(p, v0);
        _mm512_storeu_ps(p + 16, v1);
        _mm512_storeu_ps(p + 32, v2);
        _mm512_storeu_ps(p + 48, v3);
      }
    }
  };
  // Every row's pieces are whole aligned lines when the first row's are and rows are whole lines apart.
  const bool nt = t.stream && ((uintptr_t)c0 & 63) == 0 && (ldc * (int64_t)sizeof(TO)) % 64 == 0;
  if (t.bias) {
    if (nt) rows(Bool<true>{}, Bool<true>{});
    else rows(Bool<false>{}, Bool<true>{});
  } else if (nt) {
    rows(Bool<true>{}, Bool<false>{});
  } else {
    rows(Bool<false>{}, Bool<false>{});
  }
}

template <Dt O, int R, bool kNativeBf16 = false>
inline void fma_store(const Task& t, int64_t row0, int64_t col0, int64_t nc, __m512 (&acc)[kMR][4], const float* bias) {
  using TO = typename Ty<O>::T;
  if constexpr (O == Dt::f32 || (O == Dt::bf16 && kNativeBf16)) {
    if (nc == 64 && t.c_sn == 1 && (O == Dt::bf16 || t.stream)) {
      fma_store_full<O, R>(t, row0, col0, acc, bias);
      return;
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    TO* crow = (TO*)t.c + (row0 + i) * t.c_sm + col0 * t.c_sn;
    if (O == Dt::bf16 && kNativeBf16 && t.c_sn == 1) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int64_t left = nc - 32 * h;
        if (left <= 0) break;
        const __m512 lo = _mm512_add_ps(acc[i][2 * h], _mm512_load_ps(bias + 32 * h));
        const __m512 hi = _mm512_add_ps(acc[i][2 * h + 1], _mm512_load_ps(bias + 32 * h + 16));
        uint16_t* p = (uint16_t*)crow + 32 * h;
        put_bf16x32(p, f32_to_bf16x32_native(lo, hi), mask32(left), stream_bf16x32(t, p, left));
      }
      continue;
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      if (j * 16 >= nc) break;
      const __m512 v = _mm512_add_ps(acc[i][j], _mm512_load_ps(bias + 16 * j));
      if (O == Dt::f32 && stream_f32x16(t, crow + 16 * j, nc - 16 * j)) {
        stream_ps512((float*)(crow + 16 * j), v);
      } else {
        put16_f32<O>(crow + 16 * j * t.c_sn, t.c_sn, v, nc - 16 * j);
      }
    }
  }
}

template <Dt O, int R, bool = false>
inline void fma_store(const Task& t, int64_t row0, int64_t col0, int64_t nc, __m512d (&acc)[kMR][4], const double* bias) {
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    double* crow = (double*)t.c + (row0 + i) * t.c_sm + col0 * t.c_sn;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      if (j * 8 >= nc) break;
      const __m512d v = _mm512_add_pd(acc[i][j], _mm512_load_pd(bias + 8 * j));
      if (t.c_sn == 1) {
        masked_store_pd(crow + 8 * j, mask8(nc - 8 * j), v);
      } else {
        alignas(64) double tmp[8];
        _mm512_store_pd(tmp, v);
        for (int64_t x = 0; x < imin(8, nc - 8 * j); ++x) crow[(8 * j + x) * t.c_sn] = tmp[x];
      }
    }
  }
}

// One k block of R rows: accumulators start at zero (first block) or from `part`; the last
// block writes C, the others park the partial sums in `part` (R x 4 vectors).
// Kept out of line: inlined into fma_item (as the prefetch's extra arguments made GCC do), the
// k loops reloaded their row pointers from the stack and the weight gradient ran ~10% slower.
template <class VT, Dt O, int R>
__attribute__((noinline)) void fma_rows(const Task& t, int64_t row0, int64_t col0, int64_t nc, const typename VT::S* a, int64_t lda,
                     const typename VT::S* b, int64_t kc, bool first, bool last, typename VT::S* part,
                     const typename VT::S* bias, const char* pf, int64_t pf_lines, bool perm, const RawPanel* raw,
                     bool kmajor) {
  constexpr int64_t NR = 4 * VT::L;
  typename VT::V acc[kMR][4];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 4; ++j) acc[i][j] = first ? VT::zero() : VT::load(part + i * NR + j * VT::L);
  }
  auto kernel = [&](auto km) {
    constexpr bool KM = decltype(km)::value;
    if constexpr (VT::kPairs) {
      if (raw) vb_raw_kernel<R, KM>(a, lda, *raw, kc, acc, pf, pf_lines);
      else fma_kernel<VT, R, KM>(a, lda, b, kc, acc, pf, pf_lines);
    } else if constexpr (sizeof(typename VT::S) == 4) {
      if (raw) vf_raw_kernel<R, KM>(a, lda, *raw, kc, acc, pf, pf_lines);
      else fma_kernel<VT, R, KM>(a, lda, b, kc, acc, pf, pf_lines);
    } else {
      fma_kernel<VT, R, KM>(a, lda, b, kc, acc, pf, pf_lines);
    }
  };
  if (sizeof(typename VT::S) == 4 && kmajor) kernel(Bool<true>{});
  else kernel(Bool<false>{});
  if (last) {
    if constexpr (VT::kPairs) {
      if (perm) {
#pragma GCC unroll 6
        for (int i = 0; i < R; ++i) {
          pair_unpack(acc[i][0], acc[i][1]);
          pair_unpack(acc[i][2], acc[i][3]);
        }
      }
    }
    fma_store<O, R, VT::kPairs>(t, row0, col0, nc, acc, bias);
  } else {
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      for (int j = 0; j < 4; ++j) VT::store(part + i * NR + j * VT::L, acc[i][j]);
    }
  }
}

// Rows of an FMA item, 6..240: its packed rows of A within 512 KiB of fp32 / fp64 words, or
// 1 MiB of bf16 pairs (VB: 2 bytes per k). Each item packs its own copy of its columns of the
// group's weights, so a cap in rows reads a large group's weights from memory once per that many
// rows: with VB items cut like fp32 ones (512 KiB of 4 bytes per k), the bf16 input gradient
// ([G, K, N] weights) on the Zen 4 VM (2 threads, Dirichlet sizes, caches flushed, one process
// alternating, 12 rounds, medians, ratio to dense; 2026-11-30), before -> after: G=8, M=1024,
// K=14336, N=512 x2.23 / x2.30 -> x1.33 / x1.24; G=8, M=2048, K=4096, N=1024 x1.33 / x1.32 /
// x1.23 -> x1.21 / x1.15 / x1.08; G=8, M=4096, K=3584, N=1024 x1.26 / x1.33 -> x1.13 / x1.15;
// 2 and 4 MiB measured as 1 MiB; weight gradient G=8, M=4096, K=1024, N=2048 (K here: a group's
// ~512 rows) x1.00 -> x0.96, M=8192, N=1024 x1.07 -> x1.02; G=64, M=2048, K=N=512 (240 rows
// both) level.
int64_t fma_item_rows(Dt in, int64_t K, bool pairs) {
  const int64_t bytes = (in == Dt::f64 ? 8 : pairs ? 2 : 4) * imax(K, 1);
  return imax(kMR, imin(240, ((pairs ? 1024 : 512) * 1024 / bytes) / kMR * kMR));
}

// Column-major A (the weight gradient's x^T: rows of the item are contiguous, k strided) is
// packed k-major, [K (VB: pairs)][ldk] (pack_a_kmajor), and the kernels broadcast A[r, k] from
// a + k * ldk + r: packing is then a copy in memory order instead of 16 x 16 transposes (of
// which half the vectors were zeros at a group's 16 rows: 8 pairs), and the next item's rows of
// A are prefetched while this one computes (fma_item). For items of kKmajorMinRows rows and
// more; ldk is the rows rounded up past a register block, plus one line so that the rows of k
// are not a multiple of 4 KiB apart. Measured on the Zen 4 VM (weight gradient, Dirichlet sizes,
// 2 threads, one process alternating, caches flushed, 12-16 rounds, medians, 2026-12-01),
// row-major -> k-major: bf16 G=256, M=4096, K=512, N=256 4.93 -> 4.62 ms and 4.79 -> 4.45 ms
// (x1.53 -> x1.42), G=64, M=2048, K=N=512 3.74 -> 3.60 ms, Qwen3-30B-A3B /4 3.66 -> 3.44 ms,
// DeepSeek-V3 /16 2.90 -> 2.65 ms, GPT-OSS-20B /4 8.76 -> 8.40 ms, OLMoE /2 13.79 -> 13.48 ms,
// G=8 (M=4096, K=1024, N=2048; K=4096, N=1024) level to 4% faster; fp32 G=256 7.78 -> 7.56 ms,
// G=64 6.21 -> 6.12 ms. The prefetch is a quarter to a half of that (without it: G=256 4.93 ->
// 4.69 ms, G=64 3.74 -> 3.67 ms).
// The AVX2 level's panels of kMR rows (kernels_avx2.cpp pack_a: a row block's k steps one
// contiguous run) were slower here: measured on the Zen 4 VM (2026-12-07, same method, 12
// rounds), one array -> panels, fp32 G=8, M=4096, K=1024, N=2048 92.6 -> 93.8 ms, G=64 5.95 ->
// 6.13 ms, G=256 7.33 -> 7.78 ms; bf16 G=8 43.4 -> 44.3 ms, G=64 3.32 -> 3.43 ms, G=256 4.04 ->
// 4.24 ms (and 6.6 / 4.7% at G=256 with one unmasked 16-lane store per panel and k instead of a
// 6-lane masked one).
constexpr int64_t kKmajorMinRows = 24;
int64_t kmajor_ldk(int64_t rows) { return round_up(rows + kMR, 16) + 16; }
bool kmajor_a(const Task& t, int64_t rows, int64_t s) { return s == 4 && t.a_sm == 1 && t.a_sk != 1 && rows >= kKmajorMinRows; }

constexpr int64_t kPartBytes = 256 * 1024;  // partial sums of one item's C block (L2)
constexpr int64_t kWindowRows = 16;          // rows of A per slab of B prefetched ahead (fma_item)
constexpr int64_t kWindowBytes = 512 * 1024;  // the farthest fma_item prefetches past its slab
// gemvt_item's sums (y) fit in the room fma_workspace keeps for the packed B.
static_assert(kGemvRows * kGemvtCols + 64 <= kKC * kWideCols, "gemvt_item's sums fit in the FMA workspace");

int64_t fma_workspace(Dt in, int64_t K, bool pairs) {
  const int64_t s = in == Dt::f64 ? 8 : 4;
  const int64_t rows = round_up(fma_item_rows(in, K, pairs), kMR), ku = pairs ? ceil_div(K, 2) : K;
  const int64_t lda = s == 8 ? fma_lda<double>(ku) : fma_lda<float>(ku);
  const int64_t b = imax(kKC * kWideCols, imax(K, 1) * (256 / s));
  const int64_t a = imax(rows * lda, rows >= kKmajorMinRows ? ku * kmajor_ldk(rows) : 0);
  return (a + b + kWideCols) * s + kPartBytes + 5 * 64;
}

// Software prefetch (into L2) of the block of B that an item packs next, spread over the
// compute of the current block: the FMA loop issues one line per k step (~12 cycles apart), so
// the weights stream from memory while the FMA units work instead of in a separate pack phase.
// (Issuing each step's share back to back filled the line-fill buffers: the prefetches
// themselves then stalled, 45% of the item's time.) The block is `rows` runs of `run_bytes`,
// `stride` bytes apart, starting `offset` bytes past p; `calls` compute steps share it. A
// prefetch never faults, so a guess past the end of B (the next group's weights, which this
// thread usually packs next) costs only the instruction. Measured here (2 threads, issue #6
// shapes, 3 alternating runs, medians): fp32 G=64 fwd / dgrad 6.9 -> 5.7 / 6.8 -> 5.6 ms,
// G=256 12.5 -> 9.1 / 11.2 -> 8.3 ms; fp64 5-18% faster; fp16 at G=256 7% faster, at G=64 (32 MB
// of weights, which stay in this guest's L3 when one case repeats) 2-9% slower; weight
// gradients within the noise.
// The end of the widest window of weights this thread has prefetched in this call (fma_item's
// slabs of whole rows; reset by thread_begin).
static thread_local uintptr_t tl_window_end = 0;

// One prefetch into L2 per 4 KiB page of `rows` runs of `run` bytes, `stride` bytes apart, from p
// (fma_item: only with Task::far_prefetch, i.e. on AMD; vbs_item: the AVX512-BF16 CPUs without AMX),
// a block of weights further ahead than the line prefetches (PrefetchBlock) reach: so that, we
// take it, the page walks of those pages (nested ones under a hypervisor) are done before the
// line prefetches come (this VM exposes no counters to confirm the cause; perf put 11-14% of the
// hot loops' samples on their line prefetches). Measured on the Zen 4 VM (bf16 unless said, 2
// threads, one process alternating, caches flushed, 10-20 rounds, medians, 2026-12-01), without
// -> with: forward with [G, N, K] weights (vbs_item: the slice after the next), G=64, M=2048,
// K=N=512 4.07 -> 3.67 ms (Dirichlet sizes), 3.89 -> 3.41 ms (groups of 32); G=256, M=4096, K=512,
// N=256 5.28 -> 4.79 ms, 4.66 -> 3.96 ms (groups of 16); Qwen3-30B-A3B /4 3.26 -> 2.91 ms,
// DeepSeek-V3 /16 2.37 -> 2.25 ms, GPT-OSS-20B /4 8.15 -> 7.72 ms, OLMoE /2 12.47 -> 11.66 ms,
// Mixtral /4 20.44 -> 19.68 ms, G=8 level; input gradient with [G, K, N] weights (fma_item: the
// slab past the prefetch window) G=64 3.73 -> 3.60 ms, 3.44 -> 3.25 ms, G=256 4.88 -> 4.71 ms,
// 4.05 -> 3.80 ms, fp32 G=256 8.10 -> 7.86 ms, the model shapes 0-4%; weight gradients level. The
// fp32 forward's panels of [G, N, K] weights (the panel after the next): level (7.17 / 9.06 ->
// 7.28 / 9.16 ms at G=64 / G=256), not used there.
inline void warm_pages(const void* p, int64_t rows, int64_t stride, int64_t run) {
  uintptr_t last = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const uintptr_t b = (uintptr_t)p + r * stride, e = b + run;
    for (uintptr_t q = b; q < e; q = (q & ~(uintptr_t)4095) + 4096) {
      if ((q >> 12) != last) _mm_prefetch((const char*)q, _MM_HINT_T1);
      last = q >> 12;
    }
  }
}

// VT: VF (fp32 accumulation) for f32 / bf16 / f16 inputs, VD for f64.
//
// B (the expert weights, read once per call) is read from memory in blocks laid out in memory
// order, as long sequential runs, which the prefetchers stream at full bandwidth: when its rows
// are contiguous, slabs of kKC rows x up to kWideCols columns; when it is k-contiguous, panels of
// 64 columns x all of K (the previous panel's compute prefetches them whole into L2, and the
// packing takes them from there a k block at a time). Measured here (1 thread, G=64, M=2048,
// K=N=512, fp32, distinct weights per group): packing 128 x 64 blocks (256 B of each of 128 rows
// 2 KiB apart) streamed the weights at ~10 GB/s, against ~24 GB/s for a sequential read.
// With VB the packed operands and the k loops count pairs of k (KU of them) instead of k.
template <class VT, Dt D, Dt O>
void fma_item(const Task& t, const Item& it, void* ws) {
  using S = typename VT::S;
  constexpr int64_t NR = 4 * VT::L, U = VT::kPairs ? 2 : 1;
  const int64_t rows = it.m1 - it.m0, cols = it.n1 - it.n0, K = t.k, KU = ceil_div(K, U), lda = fma_lda<S>(KU);
  if constexpr (sizeof(S) == 4) {
    if (t.b_sk == 1 && t.b_sn != 1 && t.m <= fma_gemv_rows<VT, D>()) {
      gemv_item<D, O>(t, it, ws);
      return;
    }
    if (gemvt_task(t, VT::kPairs)) {
      gemvt_item<D, O>(t, it, ws);
      return;
    }
  }
  const int64_t rows_p = round_up(rows, kMR), esz = (int64_t)sizeof(typename Ty<D>::T);
  auto align = [](S* p) { return (S*)(((uintptr_t)p + 63) & ~(uintptr_t)63); };
  const bool kmajor = kmajor_a(t, rows, sizeof(S));
  const int64_t ldk = kmajor_ldk(rows);
  S* ap = align((S*)ws);
  S* bp = align(ap + (kmajor ? KU * ldk : rows_p * lda));
  S* bias = align(bp + imax(kKC * kWideCols, imax(KU, 1) * NR));
  S* part = align(bias + kWideCols);
  if (kmajor) {
    if constexpr (sizeof(S) == 4) pack_a_kmajor<D, VT::kPairs>(t, it, (float*)ap, ldk);
  } else if constexpr (VT::kPairs) {
    pair_pack_a(t, it, ap, lda);
  } else {
    fma_pack_a<D, S>(t, it, ap, lda);
  }
  auto pack_b = [&](int64_t k0, int64_t kc, int64_t n0, int64_t nc, S* dst) {
    if constexpr (VT::kPairs) pair_pack_b(t, k0, kc, n0, nc, dst);
    else fma_pack_b_into<D>(t, k0, kc, n0, nc, dst);
  };

  // VB with n-contiguous B: its panels in pair_unpack's order, built by their first row block
  // (RawPanel; half the packing instructions of column order, which is restored once per output
  // row piece) where the sums are long enough to repay that (kPermMinK).
  const bool perm = VT::kPairs && t.b_sn == 1 && K >= kPermMinK;
  const bool raw_f32 = !VT::kPairs && D == Dt::f32 && t.b_sn == 1;  // (see RawPanel)
  auto rows_block = [&](int64_t mb, int64_t col0, int64_t nc, const S* b, int64_t k0, int64_t kc, S* pb,
                        const S* bias_blk, PfRun pf, const RawPanel* raw = nullptr) {
    const int64_t la = kmajor ? ldk : lda;
    const S* a = kmajor ? a_at<true>(ap, la, mb, k0) : a_at<false>(ap, la, mb, k0);
    const bool first = k0 == 0, last = k0 + kKC >= KU;
    const int64_t row0 = it.m0 + mb;
    switch (imin(kMR, rows - mb)) {
      case 6: fma_rows<VT, O, 6>(t, row0, col0, nc, a, la, b, kc, first, last, pb, bias_blk, pf.first, pf.lines, perm, raw, kmajor); break;
      case 5: fma_rows<VT, O, 5>(t, row0, col0, nc, a, la, b, kc, first, last, pb, bias_blk, pf.first, pf.lines, perm, raw, kmajor); break;
      case 4: fma_rows<VT, O, 4>(t, row0, col0, nc, a, la, b, kc, first, last, pb, bias_blk, pf.first, pf.lines, perm, raw, kmajor); break;
      case 3: fma_rows<VT, O, 3>(t, row0, col0, nc, a, la, b, kc, first, last, pb, bias_blk, pf.first, pf.lines, perm, raw, kmajor); break;
      case 2: fma_rows<VT, O, 2>(t, row0, col0, nc, a, la, b, kc, first, last, pb, bias_blk, pf.first, pf.lines, perm, raw, kmajor); break;
      default: fma_rows<VT, O, 1>(t, row0, col0, nc, a, la, b, kc, first, last, pb, bias_blk, pf.first, pf.lines, perm, raw, kmajor); break;
    }
  };

  // Row-major A: the rows after this item's (the next rows of this group, or the next group's
  // first, guessed as many) into L2, one share per register block, for an item that ends its
  // rows' columns (else the next item has the same rows): the packing read them from memory
  // (perf, bf16 input gradient at G=256: pair_pack_a 7% of the samples, most after its loads).
  // Measured on the Zen 5 VM (2 threads, one process alternating, caches flushed, 10-20 rounds,
  // medians, 2026-12-02), without -> with: bf16 input gradient G=256, M=4096, K=512, N=256 3.24
  // -> 2.94 ms (Dirichlet sizes), 2.94 -> 2.74 ms (groups of 16), G=64, M=2048, K=N=512 2.15 ->
  // 2.12, 2.32 -> 2.20 ms (groups of 32); fp32 forward / input gradient G=64 4.81 / 4.24 -> 4.54 /
  // 4.20 ms, G=256 6.20 / 5.28 -> 6.01 / 5.12 ms; G=8, M=4096, K=1024, N=2048 level.
  auto next_rows_ahead = [&](int64_t calls) {
    const bool on = !kmajor && t.a_sk == 1 && it.n1 == t.n;
    return PrefetchBlock(t.a, it.m1 * t.a_sm * esz, on ? rows : 0, t.a_sm * esz, K * esz, calls);
  };
  if (t.b_sk == 1 && t.b_sn != 1) {
    // k-contiguous B: panels of 64 columns (64 runs of K elements, the next one prefetched into
    // L2 over this one's compute), each packed a k block at a time right before its row blocks
    // use it, into the same kKC x 64 buffer (32 KiB), which then stays in L1 where a
    // whole packed panel (128 KiB at K = 512) went back to L2 before its first block was read.
    // Measured on the Intel AMX VM (fp32 forward, 2 threads, one process alternating call by
    // call, caches flushed, 16-24 rounds, medians, 2026-12-03), whole panel -> per k block: G=64,
    // M=2048, K=N=512 -1.4% to -4.3% in four runs of five (one +0.5% while the host slowed
    // 25%), shared weights -2% / -4%; G=256, M=4096, K=512, N=256 -0.1% to -4.2% in six; fp16
    // -1.3% / -3.0%, fp64 -1.1% / -0.4%; G=8 and G=128 level.
    const int64_t calls = imax(1, ceil_div(KU, kKC)) * ceil_div(rows, kMR);
    PrefetchBlock a_ahead = next_rows_ahead(calls * ceil_div(cols, NR));
    for (int64_t nb = 0; nb < cols; nb += NR) {
      const int64_t nc = imin(NR, cols - nb), col0 = it.n0 + nb;
      load_bias<D>(t, col0, nc, bias, NR);
      // The next 64 rows of B^T (columns col0 + 64 ...), past the item's end too.
      PrefetchBlock ahead(t.b, (col0 + NR) * t.b_sn * esz, NR, t.b_sn * esz, K * esz, calls);
      for (int64_t k0 = 0; k0 == 0 || k0 < KU; k0 += kKC) {  // K == 0: one pass, C = bias
        const int64_t kc = imin(kKC, KU - k0);
        pack_b(k0, kc, col0, nc, bp);
        for (int64_t mb = 0; mb < rows; mb += kMR) {
          a_ahead.take().to_l2();
          rows_block(mb, col0, nc, bp, k0, kc, part + mb * NR, bias, ahead.take());
        }
      }
    }
    return;
  }
  // Row-major (or any) B: slabs of kKC rows x `wide` columns; partial sums for rows x wide.
  const int64_t wide = imax(NR, imin(imin(kWideCols, round_up(cols, NR)),
                                     (kPartBytes / (int64_t)sizeof(S) / rows_p) / NR * NR));
  // The next item's rows of A into L2 over this item's blocks; with k-major A: this task's next
  // rows, or the next task's first (its k rows follow this task's in memory; guessed as many).
  PrefetchBlock a_ahead = [&] {
    int64_t calls = 0;
    for (int64_t nw = 0; nw < cols; nw += wide) calls += ceil_div(imin(wide, cols - nw), NR) * imax(1, ceil_div(KU, kKC));
    calls *= ceil_div(rows, kMR);
    if (!kmajor) return next_rows_ahead(calls);
    const bool more = it.m1 < t.m;
    const int64_t next_rows = more ? imin(rows, t.m - it.m1) : imin(t.m, fma_item_rows(D, K, VT::kPairs));
    return PrefetchBlock(t.a, more ? it.m1 * esz : K * t.a_sk * esz, K, t.a_sk * esz, next_rows * esz, calls);
  }();
  for (int64_t nw = 0; nw < cols; nw += wide) {
    const int64_t wc = imin(wide, cols - nw), nsub = ceil_div(wc, NR);
    load_bias<D>(t, it.n0 + nw, wc, bias, nsub * NR);
    for (int64_t k0 = 0; k0 == 0 || k0 < KU; k0 += kKC) {
      const int64_t kc = imin(kKC, KU - k0);
      if (t.b_sn == 1) {
        if constexpr (VT::kPairs) {
          if (!perm) pair_pack_b_rows(t, k0, kc, it.n0 + nw, wc, bp);  // (perm: see RawPanel)
        }
        else if (!raw_f32) fma_pack_b_rows<D>(t, k0, kc, it.n0 + nw, wc, bp);
      } else {
        for (int64_t sb = 0; sb < nsub; ++sb) pack_b(k0, kc, it.n0 + nw + sb * NR, imin(NR, wc - sb * NR), bp + sb * kc * NR);
      }
      // The next slab: the rows after this one, same columns (only for contiguous rows, the
      // layout slabs are packed from). Past K they are the next group's ([G, K, N] weights), as
      // many as this slab has: worth it when this item ends its task, so that this thread's next
      // item is usually the next group's; otherwise (e.g. the weight gradient's row blocks of
      // one group) not. With whole rows (the slab is contiguous bytes), on AMD (Task::far_prefetch:
      // slower on the Intel AMX-class VM, figures at default_far_prefetch), a window instead, which
      // grows with the compute of each slab: by rows / kWindowRows slabs (at least one) past the
      // end of the widest window so far, up to 4 slabs and kWindowBytes past this slab, issued
      // whole from this slab's end every time (lines already on their way cost only the
      // instruction). The compute of a large group then prefetches the weights of the small ones
      // after it, which alone leave the memory busier than the cores. Measured on the Zen 4 VM
      // (input gradient, bf16, 2 threads, one process alternating, caches flushed, 20-30 rounds,
      // medians, ratio to dense; 2026-12-01), next slab -> window: G=256, M=4096, K=512, N=256
      // x1.81 / x1.83 / x1.91 -> x1.73 / x1.72 / x1.80 (Dirichlet sizes), x1.58 / x1.71 / x1.56 ->
      // x1.59 / x1.71 / x1.57 (equal); G=64, M=2048, K=N=512 x1.48 / x1.54 / x1.52 -> x1.46 / x1.53
      // / x1.48 (Dirichlet), x1.42 / x1.46 / x1.45 -> x1.36 / x1.38 / x1.40 (equal); weight
      // gradients and G=8-128 model shapes level; fp32 (16 rounds) G=256 x1.49 -> x1.43
      // (Dirichlet), x1.26 -> x1.30 (equal), G=64 x1.19 / x1.27 -> x1.15 / x1.23. Each line once
      // (only the window's new part): from 2% better to 6% worse; 4 slabs ahead whatever the
      // rows: equal groups of 16 rows 2-6% slower.
      // (Rows of B, not pairs: ke is the first row past this slab.)
      const int64_t ke = imin(K, (k0 + kc) * U), calls = nsub * ceil_div(rows, kMR);
      const bool ahead_ok = t.b_sn == 1 && (ke < K || it.m1 == t.m);
      PrefetchBlock ahead = [&] {
        if (t.far_prefetch && ahead_ok && wc == t.n && t.b_sk == t.n && ke > k0 * U) {
          const uintptr_t end = (uintptr_t)t.b + ke * t.b_sk * esz;
          const int64_t slab = (ke - k0 * U) * wc * esz;
          const uintptr_t from = tl_window_end > end ? tl_window_end : end;
          const uintptr_t cap = end + imin(kWindowBytes, 4 * slab);
          uintptr_t to = from + imax(slab, slab * rows / kWindowRows);
          if (to > cap) to = cap;
          if (to > tl_window_end) tl_window_end = to;
          warm_pages((const void*)to, 1, 0, slab);  // the slab past the window
          return PrefetchBlock((const void*)end, 0, 1, 0, (int64_t)(to - end), calls);
        }
        const int64_t ahead_rows = !ahead_ok ? 0 : ke < K ? imin(kKC * U, K - ke) : ke - k0 * U;
        if (t.far_prefetch) {
          warm_pages((const char*)t.b + ((ke + ahead_rows) * t.b_sk + it.n0 + nw) * esz, ahead_rows, t.b_sk * esz, wc * esz);
        }
        return PrefetchBlock(t.b, (ke * t.b_sk + it.n0 + nw) * esz, ahead_rows, t.b_sk * esz, wc * esz, calls);
      }();
      for (int64_t sb = 0; sb < nsub; ++sb) {
        const int64_t col0 = it.n0 + nw + sb * NR, nc = imin(NR, wc - sb * NR);
        const bool from_rows = perm || raw_f32;
        const RawPanel raw{(const char*)t.b + (k0 * U * t.b_sk + col0) * esz, t.b_sk, K - k0 * U, nc,
                           rows > kMR ? (float*)(bp + sb * kc * NR) : nullptr};
        for (int64_t mb = 0; mb < rows; mb += kMR) {
          a_ahead.take().to_l2();
          rows_block(mb, col0, nc, bp + sb * kc * NR, k0, kc, part + (mb * nsub + sb * kMR) * NR, bias + sb * NR,
                     ahead.take(), from_rows && mb == 0 ? &raw : nullptr);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// VB, swapped: C^T = W @ A^T for k-contiguous weights (mat_b = W.transpose(1, 2), W [G, N, K])
// and k-contiguous A, with 256-bit vectors along the rows of A. The direct scheme above puts
// the columns of C in the vector lanes, so every group's weights are transpose-packed (16 x 16
// word transposes) before use; here the weights are the broadcast operand, read in place, and
// only the group's rows of A are packed, once per item. A vector holds 4 rows x 2 pairs of k
// (lane 2i: row i, pair 2q; lane 2i + 1: row i, pair 2q + 1), so that a broadcast 64-bit word of
// W (its 4 bf16 of k = 4q .. 4q + 3) meets each row's own 4 k, and the two lanes of a row are
// added at the end. The price is a group's rows rounded up to a multiple of 4 (1.5 rows per
// group on average; with 8 rows per vector, one pair each, it was 3.5, and G=256 with equal
// groups of 12 rows took as long as with 16); groups of 3 to kVbsPairRowsBelow - 1 rows take
// vectors of 2 rows x 4 pairs instead (lanes 4i .. 4i + 3: row i, pairs 4q .. 4q + 3, against a
// broadcast 128-bit piece of W), rounded up to 2 (VR, the rows per vector, is a template
// parameter of the functions below). On CPUs that split 512-bit operations into two
// 256-bit halves (AMD Zen 4), VDPBF16PS on ymm runs at twice the rate of zmm, the same
// multiply-adds per cycle (measured here: 3.62 G zmm / 7.24 G ymm instructions per second, 231
// GFLOP/s both). In the first version (8 rows per vector, 32-bit words of W) the register
// blocks ran at 220 GFLOP/s on one core with data in L1 with the broadcasts as separate loads,
// and at 88 GFLOP/s with them folded into VDPBF16PS as {1to8} operands (one load each).
// Measured on a 2-core AMD EPYC (Zen 4) VM (2026-11-30, 2 threads, forward with [G, N, K]
// weights in 4 KiB pages, direct and swapped alternating call by call in one process, 48 MiB
// written between calls, group sizes drawn anew per call, 6-20 rounds, medians, ratio to one
// dense torch.mm): G=8, M=4096, K=1024, N=2048 x1.06 -> x1.02; G=64, M=2048, K=N=512 x1.51 ->
// x1.40; G=256, M=4096, K=512, N=256 x2.06 -> x1.75; Mixtral /4 x1.18 -> x1.15, GPT-OSS-20B /4
// x1.55 -> x1.23, OLMoE /2 x1.40 -> x1.34, Qwen3-30B-A3B /4 x1.62 -> x1.51, DeepSeek-V3 /16
// x2.25 -> x1.91. With one weight matrix shared by all groups (the compute alone): G=64 x1.41 ->
// x1.21, G=256 x1.69 -> x1.32; the rest is streaming the weights, a nested page walk per 4 KiB
// page on this VM that prefetching does not hide (README, "Huge pages for the weights").
// The weights' prefetch: the next slice of W (32 rows) into L2 during this one; a further
// window (128-512 KiB ahead, so that small groups find their weights in L2) measured 1-4%
// better with Dirichlet sizes and 1-7% worse with equal ones, and is not used. The same scheme
// for fp32 (4 rows x 2 k per vector, FMA) measured level with the direct one on G=64 / G=256
// and 4-6% slower with the caches flushed (2 threads), and is not used.
constexpr int64_t kVbsCols = 8;    // columns of C (rows of W) per register block of 2-3 vectors
constexpr int64_t kVbsSlice = 32;  // columns of C per stored block (store_block_transposed's fast case)
// k per block (1024: 256 quads, 128 octets): 2 KiB of each of 8-16 rows of W. Measured (2
// threads, forward, one process alternating, caches flushed between calls), 64 / 128 / 256
// quads: G=64, M=2048, K=N=512 x1.48 / x1.41 / -; G=256, M=4096, K=512, N=256 x1.89 / x1.79 /
// -; OLMoE /2 (K=1024) x1.36 / x1.30 / x1.25; G=8, M=4096, K=1024, N=2048 x1.13 / x1.08 / x1.05 (fewer passes over
// the partial sums); at K=2048 and 4096, 128-1024 quads within the noise.
constexpr int64_t kVbsKC = 1024;

// Rows [m0, m1) of A (k-contiguous) by 4 rows x 4 k: quad q of rows 4R .. 4R + 3 at
// dst + (R * KQ + q) * 8 (32-bit words), row i's 4 bf16 in words 2i, 2i + 1; zero past K and in
// the rows up to a multiple of 4.
// With VR = 2 (see vbs_pair_rows): 2 rows x 8 k, octet o of rows 2R, 2R + 1 at dst + (R * KQ +
// o) * 8, row i's 8 bf16 in words 4i .. 4i + 3; zero past K and in a last odd row.
template <int VR>
void vbs_pack_a(const Task& t, const Item& it, uint32_t* dst, int64_t KQ) {
  const int64_t rows = it.m1 - it.m0, K = t.k;
  const uint16_t* a = (const uint16_t*)t.a + it.m0 * t.a_sm;
  if constexpr (VR == 2) {
    for (int64_t r0 = 0; r0 < rows; r0 += 2) {
      uint32_t* d = dst + (r0 / 2) * KQ * 8;
      const uint16_t* a0 = a + r0 * t.a_sm;
      const bool two = r0 + 1 < rows;
      for (int64_t o0 = 0; o0 < KQ; o0 += 2) {
        const __mmask16 km = mask16(K - 8 * o0);
        const __m256i x0 = masked_load_epi16x16(km, a0 + 8 * o0);  // octets o0, o0 + 1 of row r0
        const __m256i x1 = two ? masked_load_epi16x16(km, a0 + t.a_sm + 8 * o0) : _mm256_setzero_si256();
        _mm256_store_si256((__m256i*)(d + o0 * 8), _mm256_permute2x128_si256(x0, x1, 0x20));
        if (o0 + 1 < KQ) _mm256_store_si256((__m256i*)(d + (o0 + 1) * 8), _mm256_permute2x128_si256(x0, x1, 0x31));
      }
    }
    return;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    uint32_t* d = dst + (r0 / 4) * KQ * 8;
    for (int64_t q0 = 0; q0 < KQ; q0 += 4) {
      const __mmask16 km = mask16(K - 4 * q0);
      __m256i r[4];  // quads q0 .. q0 + 3 of row r0 + i
      for (int64_t i = 0; i < 4; ++i) {
        r[i] = r0 + i < rows ? masked_load_epi16x16(km, a + (r0 + i) * t.a_sm + 4 * q0) : _mm256_setzero_si256();
      }
      const __m256i lo01 = _mm256_unpacklo_epi64(r[0], r[1]), hi01 = _mm256_unpackhi_epi64(r[0], r[1]);
      const __m256i lo23 = _mm256_unpacklo_epi64(r[2], r[3]), hi23 = _mm256_unpackhi_epi64(r[2], r[3]);
      const __m256i q[4] = {_mm256_permute2x128_si256(lo01, lo23, 0x20), _mm256_permute2x128_si256(hi01, hi23, 0x20),
                            _mm256_permute2x128_si256(lo01, lo23, 0x31), _mm256_permute2x128_si256(hi01, hi23, 0x31)};
      // The full case spelled out: as one loop bounded by imin(4, KQ - q0), GCC stored q[] on the
      // stack and copied it with `rep movsq` (a fifth of this function's samples in perf).
      if (KQ - q0 >= 4) {
        for (int64_t x = 0; x < 4; ++x) _mm256_store_si256((__m256i*)(d + (q0 + x) * 8), q[x]);
      } else {
        for (int64_t x = 0; x < imin(4, KQ - q0); ++x) _mm256_store_si256((__m256i*)(d + (q0 + x) * 8), q[x]);
      }
    }
  }
}

// The k loop of the swapped schemes' register blocks: steps 0 .. kc - 1 of step(q, load_w), with
// load_w = load_full (W's piece for the step, up to 128 bits, from a row of W) except on the last
// step where it has only `tail` valid k (read masked: the rest is past the row), and pf_lines
// prefetches into L2 from pf spread evenly over the steps.
template <class Step, class LoadFull>
inline void vbs_steps(int64_t kc, int64_t tail, const char* pf, int64_t pf_lines, const Step& step,
                      const LoadFull& load_full) {
  const int64_t full = kc - (tail ? 1 : 0);
  int64_t due = 0;
  for (int64_t q = 0; q < full; ++q) {
    for (due += pf_lines; due >= kc; due -= kc) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
    }
    step(q, load_full);
  }
  if (tail) step(full, [tail](const uint16_t* p) { return masked_load_epi16x8(mask8(tail), p); });
}

// acc[i][j] += over quads q0 .. q0 + kc: W[i] quad q (64-bit words from w[i] + 4q, broadcast)
// times A vector j quad q (a + j * a_vec + q * 8), for i < NC columns and j < MV vectors of 4
// rows (VR = 2: octets, 128 bits of W from w[i] + 8q broadcast to both halves, vectors of 2
// rows). `tail`: the last step has K % (16 / VR) valid k, so its part of W is read masked (the
// rest is past the row). pf_lines prefetches from pf are spread evenly over the kc steps.
template <int VR, int MV, int NC>
inline void vbs_kernel(const uint32_t* a, int64_t a_vec, const uint16_t* const* w, int64_t q0, int64_t kc, int64_t tail,
                       __m256 (&acc)[NC][MV], const char* pf, int64_t pf_lines) {
  auto step = [&](int64_t q, auto load_w) {
    __m256bh av[MV];
#pragma GCC unroll 3
    for (int j = 0; j < MV; ++j) av[j] = (__m256bh)_mm256_load_si256((const __m256i*)(a + j * a_vec + q * 8));
#pragma GCC unroll 16
    for (int i = 0; i < NC; ++i) {
      const __m128i x = load_w(w[i] + (16 / VR) * (q0 + q));
      const __m256bh bw = (__m256bh)(VR == 4 ? _mm256_broadcastq_epi64(x) : _mm256_broadcastsi128_si256(x));
#pragma GCC unroll 3
      for (int j = 0; j < MV; ++j) acc[i][j] = _mm256_dpbf16_ps(acc[i][j], bw, av[j]);
    }
  };
  // An unaligned load: rows of W are 2-byte aligned when K is odd.
  vbs_steps(kc, tail, pf, pf_lines, step,
            [](const uint16_t* p) { return VR == 4 ? _mm_loadu_si64(p) : _mm_loadu_si128((const __m128i*)p); });
}

// Where a register block's finished sums go straight to C (its last k block, C n-contiguous and
// not streamed): c at the block's first row and column (f32 or bf16 elements, row stride c_sm),
// the rows and columns of it that are C's, and the bias of its columns.
struct VbsOut {
  void* c = nullptr;
  int64_t c_sm = 0, rows = 0, cols = 0;
  const float* bias = nullptr;
  bool f32 = false;
};

// Row `row` of the block, 8 columns from `col`: plus bias, rounded once, stored.
inline void vbs_put_row(const VbsOut& o, int64_t row, int64_t col, __m256 v) {
  v = _mm256_add_ps(v, _mm256_loadu_ps(o.bias + col));
  const __mmask8 cm = mask8(o.cols - col);
  const int64_t at = row * o.c_sm + col;
  if (o.f32) masked_store_ps8((float*)o.c + at, cm, v);
  else masked_store_epi16x8((uint16_t*)o.c + at, cm, f32_to_bf16x8_native(v));
}

// Row `row` of a register block's sums, 8 columns from col, where the block's sums are kept as rows
// of C (blk[r][c], row stride ldb): plus blk's partial sums unless first; then into blk, or, with
// out.c set, to C (vbs_put_row; rows past the task's are not stored).
inline void vbs_row_out(float* blk, int64_t ldb, bool first, const VbsOut& out, int64_t row, int64_t col, __m256 v) {
  float* const bp = blk + row * ldb + col;
  if (!first) v = _mm256_add_ps(v, _mm256_loadu_ps(bp));
  if (!out.c) _mm256_storeu_ps(bp, v);
  else if (row < out.rows) vbs_put_row(out, row, col, v);
}

// Rows 4j .. 4j + 3 of an 8-column piece of a register block, from s[p] = [column p: rows 0-3 |
// column p + 4: rows 0-3]: transposed in registers (8 shuffles), plus bias, rounded once, each
// row's 8 columns stored at c + row * c_sm.
inline void vbs_put(const VbsOut& o, int64_t j, int64_t col, const __m256 (&s)[4]) {
  if (o.cols <= col) return;  // columns past the task's (the second half of a 16-column block)
  const __m256 t0 = _mm256_unpacklo_ps(s[0], s[1]), t1 = _mm256_unpackhi_ps(s[0], s[1]);
  const __m256 t2 = _mm256_unpacklo_ps(s[2], s[3]), t3 = _mm256_unpackhi_ps(s[2], s[3]);
  const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE), _mm256_shuffle_ps(t1, t3, 0x44),
                       _mm256_shuffle_ps(t1, t3, 0xEE)};
  for (int64_t r = 0; r < imin(4, o.rows - 4 * j); ++r) vbs_put_row(o, 4 * j + r, col, u[r]);
}

// One register block: NC columns of C (rows w of W) x VR MV rows of the item, steps [q0, q0 +
// kc). Its sums, the lanes of each row added, go to blk (VR = 4: C^T, blk[c][r]; VR = 2: rows of
// C, blk[r][c]; row stride ldb): stored on the first k block, added to it on the others; or,
// with out.c set, (plus blk's sums unless first) to C.
template <int VR, int MV, int NC>
__attribute__((noinline)) void vbs_block(const uint32_t* a, int64_t a_vec, const uint16_t* const* w, int64_t q0, int64_t kc,
                                         int64_t tail, bool first, float* blk, int64_t ldb, PfRun pf, const VbsOut& out) {
  static_assert(NC % 8 == 0, "columns in pieces of 8");
  __m256 acc[NC][MV];
#pragma GCC unroll 16
  for (int i = 0; i < NC; ++i) {
#pragma GCC unroll 3
    for (int j = 0; j < MV; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  vbs_kernel<VR, MV, NC>(a, a_vec, w, q0, kc, tail, acc, pf.first, pf.lines);
  if constexpr (VR == 2) {
#pragma GCC unroll 2
    for (int g = 0; g < NC; g += 8) {
      if (out.c && out.cols <= g) break;  // columns past the task's (the second half of 16)
#pragma GCC unroll 3
      for (int j = 0; j < MV; ++j) {
        // [c: row 0 lanes 0-3 | row 1 lanes 0-3] -> [c, c+1: row 0 pair sums | row 1] -> [c ..
        // c+3: row 0 | row 1] -> [c .. c+7: row 0], [c .. c+7: row 1]: ((l0 + l1) + (l2 + l3)).
        __m256 h[4];
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) h[p] = _mm256_hadd_ps(acc[g + 2 * p][j], acc[g + 2 * p + 1][j]);
        const __m256 s0 = _mm256_hadd_ps(h[0], h[1]), s1 = _mm256_hadd_ps(h[2], h[3]);
        __m256 row[2] = {_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31)};
#pragma GCC unroll 2
        for (int r = 0; r < 2; ++r) vbs_row_out(blk, ldb, first, out, 2 * j + r, g, row[r]);
      }
    }
    return;
  }
#pragma GCC unroll 2
  for (int g = 0; g < NC; g += 8) {
#pragma GCC unroll 3
    for (int j = 0; j < MV; ++j) {
      __m256 s[4];
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        // [p: rows 0 1, p+4: rows 0 1 | p: rows 2 3, p+4: rows 2 3] -> [p: rows 0-3 | p+4: rows 0-3]
        s[p] = _mm256_castpd_ps(
            _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(acc[g + p][j], acc[g + p + 4][j])), 0xD8));
        float* lo = blk + (g + p) * ldb + 4 * j;
        float* hi = lo + 4 * ldb;
        if (!first) s[p] = _mm256_add_ps(s[p], _mm256_loadu2_m128(hi, lo));
        if (!out.c) _mm256_storeu2_m128(hi, lo, s[p]);
      }
      if (out.c) vbs_put(out, j, g, s);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The swapped scheme in 512-bit vectors (Task::bf16_scheme == kBf16Swapped512), for cores whose
// 512-bit VDPBF16PS does twice the multiply-adds of the 256-bit one (full-width units: measured on
// an AMD EPYC Zen 5 VM, family 0x1A, 2026-12-01: 6.50 G zmm / 6.62 G ymm VDPBF16PS per second on
// one core, 416 / 212 GFLOP/s; on Zen 4 the two rates differ by 2x instead, see above). A vector
// holds 4 rows x 4 pairs of k (128-bit lane i: row i, k = 8o .. 8o + 7 of octet o), against a
// 128-bit piece of W (its 8 bf16 of the same k) broadcast to the four lanes; rows round up to 4,
// and each row's 4 lanes are added at the end, ((p0 + p2) + (p1 + p3)). The register blocks are
// those of the 256-bit scheme (8 columns x 3 vectors, 16 columns x 1), 8 k per step.

// Rows [m0, m1) of A (k-contiguous) by 4 rows x 8 k: octet o of rows 4R .. 4R + 3 at dst + (R *
// KO + o) * 16 (32-bit words), row i's 8 bf16 in words 4i .. 4i + 3; zero past K and in the rows
// up to a multiple of 4. Four octets of four rows (one 512-bit load each) are one 4 x 4 transpose
// of 128-bit lanes.
void vbz_pack_a(const Task& t, const Item& it, uint32_t* dst, int64_t KO) {
  const int64_t rows = it.m1 - it.m0, K = t.k;
  const uint16_t* a = (const uint16_t*)t.a + it.m0 * t.a_sm;
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    uint32_t* d = dst + (r0 / 4) * KO * 16;
    for (int64_t o0 = 0; o0 < KO; o0 += 4) {
      const __mmask32 km = mask32(K - 8 * o0);
      __m512i r[4];  // octets o0 .. o0 + 3 of row r0 + i
      for (int64_t i = 0; i < 4; ++i) {
        r[i] = r0 + i < rows ? masked_load_epi16x32(km, a + (r0 + i) * t.a_sm + 8 * o0) : _mm512_setzero_si512();
      }
      const __m512i t0 = _mm512_shuffle_i64x2(r[0], r[1], 0x44), t1 = _mm512_shuffle_i64x2(r[0], r[1], 0xEE);
      const __m512i t2 = _mm512_shuffle_i64x2(r[2], r[3], 0x44), t3 = _mm512_shuffle_i64x2(r[2], r[3], 0xEE);
      const __m512i o[4] = {_mm512_shuffle_i64x2(t0, t2, 0x88), _mm512_shuffle_i64x2(t0, t2, 0xDD),
                            _mm512_shuffle_i64x2(t1, t3, 0x88), _mm512_shuffle_i64x2(t1, t3, 0xDD)};
      if (KO - o0 >= 4) {  // (spelled out for the reason given in vbs_pack_a)
        for (int64_t x = 0; x < 4; ++x) _mm512_store_si512(d + (o0 + x) * 16, o[x]);
      } else {
        for (int64_t x = 0; x < imin(4, KO - o0); ++x) _mm512_store_si512(d + (o0 + x) * 16, o[x]);
      }
    }
  }
}

// acc[i][j] += over octets q0 .. q0 + kc: W[i] octet q (128 bits from w[i] + 8q, broadcast) times
// A vector j octet q (a + j * a_vec + q * 16), for i < NC columns and j < MV vectors of 4 rows.
// `tail`: the last step has K % 8 valid k (W read masked). Prefetches as in vbs_kernel (vbs_steps).
template <int MV, int NC>
inline void vbz_kernel(const uint32_t* a, int64_t a_vec, const uint16_t* const* w, int64_t q0, int64_t kc, int64_t tail,
                       __m512 (&acc)[NC][MV], const char* pf, int64_t pf_lines) {
  auto step = [&](int64_t q, auto load_w) {
    __m512bh av[MV];
#pragma GCC unroll 3
    for (int j = 0; j < MV; ++j) av[j] = (__m512bh)_mm512_load_si512(a + j * a_vec + q * 16);
#pragma GCC unroll 16
    for (int i = 0; i < NC; ++i) {
      const __m512bh bw = (__m512bh)_mm512_broadcast_i32x4(load_w(w[i] + 8 * (q0 + q)));
#pragma GCC unroll 3
      for (int j = 0; j < MV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], bw, av[j]);
    }
  };
  vbs_steps(kc, tail, pf, pf_lines, step, [](const uint16_t* p) { return _mm_loadu_si128((const __m128i*)p); });
}

// Four accumulators (columns c .. c + 3) of 4 rows x 4 lanes -> [row 0: columns c .. c + 3 | row 1
// | row 2 | row 3], each sum ((lane 0 + lane 2) + (lane 1 + lane 3)).
inline __m512 vbz_sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return _mm512_add_ps(_mm512_shuffle_ps(x01, x23, 0x44), _mm512_shuffle_ps(x01, x23, 0xEE));
}

// One register block of the 512-bit scheme: NC columns of C x MV vectors of 4 rows, steps [q0,
// q0 + kc). Its sums go to blk as rows of C (blk[r][c], row stride ldb; stored on the first k
// block, added to it on the others) or, with out.c set, (plus blk's sums unless first) to C.
template <int MV, int NC>
__attribute__((noinline)) void vbz_block(const uint32_t* a, int64_t a_vec, const uint16_t* const* w, int64_t q0, int64_t kc,
                                         int64_t tail, bool first, float* blk, int64_t ldb, PfRun pf, const VbsOut& out) {
  static_assert(NC % 8 == 0, "columns in pieces of 8");
  __m512 acc[NC][MV];
#pragma GCC unroll 16
  for (int i = 0; i < NC; ++i) {
#pragma GCC unroll 3
    for (int j = 0; j < MV; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  vbz_kernel<MV, NC>(a, a_vec, w, q0, kc, tail, acc, pf.first, pf.lines);
#pragma GCC unroll 2
  for (int g = 0; g < NC; g += 8) {
    if (out.c && out.cols <= g) break;  // columns past the task's (the second half of 16)
#pragma GCC unroll 3
    for (int j = 0; j < MV; ++j) {
      const __m512 s0 = vbz_sum4(acc[g][j], acc[g + 1][j], acc[g + 2][j], acc[g + 3][j]);
      const __m512 s1 = vbz_sum4(acc[g + 4][j], acc[g + 5][j], acc[g + 6][j], acc[g + 7][j]);
      // s0, s1: [r0 | r1 | r2 | r3] of columns c .. c + 3 and c + 4 .. c + 7 -> [r0: c .. c + 7 |
      // r1: c .. c + 7] and rows 2, 3 alike
      const __m512 u01 = _mm512_permutex2var_ps(
          s0, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), s1);
      const __m512 u23 = _mm512_permutex2var_ps(
          s0, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), s1);
      __m256 row[4] = {_mm512_castps512_ps256(u01), _mm512_extractf32x8_ps(u01, 1), _mm512_castps512_ps256(u23),
                       _mm512_extractf32x8_ps(u23, 1)};
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) vbs_row_out(blk, ldb, first, out, 4 * j + r, g, row[r]);
    }
  }
}

// The register block of either swapped scheme: vbz_block (Z, 512-bit) or vbs_block (256-bit).
template <int VR, bool Z, int MV, int NC>
inline void swapped_block(const uint32_t* a, int64_t a_vec, const uint16_t* const* w, int64_t q0, int64_t kc,
                          int64_t tail, bool first, float* blk, int64_t ldb, PfRun pf, const VbsOut& out) {
  if constexpr (Z) vbz_block<MV, NC>(a, a_vec, w, q0, kc, tail, first, blk, ldb, pf, out);
  else vbs_block<VR, MV, NC>(a, a_vec, w, q0, kc, tail, first, blk, ldb, pf, out);
}

// Vectors of VR rows in the next register block, `left` rows to go: 3, or 2 where 3 would leave
// a single one. A block of one vector takes 16 columns at once (16 accumulators; with 8, fewer
// than VDPBF16PS's latency times its rate).
template <int VR>
int64_t vbs_vectors(int64_t left) {
  const int64_t v = ceil_div(left, VR);
  return v == 4 || v == 2 ? 2 : imin(3, v);
}

// Groups of 1-4 rows (decode) take this scheme too (1-2 rows one vector of 4 rows by 16 rows of W,
// 3-4 rows vectors of 2: see vbs_pair_rows), unless the rows of W are a multiple of 4 KiB apart
// (K = 2048, 4096, ...): the 16 rows read side by side then fall into the same L1 set (8 ways) and
// evict each other, and gemv_item (4 rows side by side) reads faster. Measured on the Zen 4 VM (2
// threads, bf16, one process alternating, 2026-12-01), gemv_item -> this: every group of G=256,
// K=512, N=256 read, groups of 1 / 4 rows 3.99 / 5.04 -> 2.60 / 2.68 ms (17 -> 26 GB/s of weights);
// G=64, K=1024, N=1024 6.98 / 9.47 -> 4.33 / 4.99 ms; the issue's G=256 forward (Dirichlet sizes, a
// fifth of the groups of 1-4 rows) 4.59 -> 3.98 ms, G=64 3.63 -> 3.44 ms, DeepSeek-V3 /16 2.50 ->
// 2.23 ms, Qwen3-30B-A3B /4 3.22 -> 3.08 ms; decode (benchmarks/decode.py's [G, N, K] cases, 1 / 4
// tokens) GPT-OSS-20B 2.74 / 9.53 -> 2.25 / 7.66 ms, DeepSeek-V3 /4 0.75 / 2.40 -> 0.62 / 1.92 ms.
// At K = 2048 / 4096 (4 / 8 KiB rows) it was 30-48% slower (OLMoE, Qwen3-30B-A3B, Mixtral decode)
// and with every row of W padded by 64 bytes level or faster: so those keep gemv_item.
// Whether bf16 rows of W are a multiple of 4 KiB apart, so that at one k they all fall into one
// L1 set (see vbs_task and kVbsStageStride).
bool w_rows_share_l1_set(const Task& t) { return (t.b_sn * 2) % 4096 == 0; }

bool vbs_task(const Task& t) {
  if (t.b_sk != 1 || t.b_sn == 1 || t.a_sk != 1) return false;
  return t.m > kGemvRows || !w_rows_share_l1_set(t);
}

// Rows of a vbs_item: the packed rows of one k block (kVbsKC quads) within 256 KiB of L2, 16 to
// 256 rows (128 from K = 1024). Each item reads its group's weights once, so FMA-sized items (A
// packed whole within 512 KiB: 32 rows at K = 4096) read a large group's weights from memory
// once per 32 rows. Measured (2 threads, forward, [G, N, K] weights, Dirichlet sizes, caches
// flushed, one process alternating, 14-16 rounds, medians, ratio to dense; 2026-11-30): G=8,
// M=2048, K=4096, N=1024 x1.23 / x1.27 -> x1.15 / x1.18; G=32, M=4096, K=4096, N=512 x1.24 /
// x1.22 -> x1.15 / x1.15; K=2048 (64 -> 128 rows) x1.15 / x1.11 -> x1.13 / x1.13; 256 rows at
// K=4096 measured as 128.
int64_t vbs_item_rows(int64_t K) {
  return imax(16, imin(256, (256 * 1024) / (2 * imax(imin(K, kVbsKC), 1))) / 16 * 16);
}

// Rows of W a multiple of 4 KiB apart (bf16 K = 2048, 4096, ...) fall into one L1 set (8 ways)
// at every k, and a block reads 8-16 of them side by side: the forward took x1.17 against x1.10
// with the same rows 64 bytes further apart (G=8, M=2048, K=2048, N=1024), x1.20 / x1.11 (G=32,
// M=4096, K=2048, N=768), x1.16 / x1.12 (K=4096). For items of kVbsStageMinRows rows and more
// (whose row blocks repay the copy), each k block of the 16 rows of W a block pair reads is
// copied into the workspace kVbsStageStride elements apart first. Measured on the Zen 4 VM (2
// threads, forward, Dirichlet sizes, one process alternating, caches flushed, 8 rounds,
// medians, 2026-12-01), in place -> staged: G=64, M=8192, K=2048, N=1024 93.4 -> 90.6 ms; G=8,
// M=2048, K=2048, N=1024 23.8 / 24.5 -> 22.8 / 23.1 ms; G=32, M=4096, K=2048, N=768 36.4 -> 35.7
// ms; G=8, M=1024 / 2048, K=4096, N=1024 26.5 / 49.3 -> 25.3 / 47.6 ms; G=128, M=4096, K=2048,
// N=768 (groups of ~32 rows) 41.4 -> 40.7 ms; from 64 rows instead of 32: the same or less gain.
constexpr int64_t kVbsStageStride = kVbsKC + 32;  // elements of a staged row: one k block + 64 B
constexpr int64_t kVbsStageMinRows = 32;
bool vbs_staged(const Task& t, int64_t rows) { return w_rows_share_l1_set(t) && rows >= kVbsStageMinRows; }

// Bytes of vbs_item's workspace for items of up to `rows` rows: A packed (either vector
// layout), the slice's sums (blk), the bias of a slice, 16 staged rows of W, and alignment.
int64_t vbs_workspace(int64_t rows, int64_t K) {
  return (round_up(rows, 16) * (ceil_div(K, 4) * 2 + 4) + round_up(rows, 16) * kVbsSlice + kVbsSlice) * 4 +
         2 * kVbsCols * kVbsStageStride * 2 + 4 * 64;
}

// Z: the 512-bit scheme (vbz_block, vectors of 4 rows; VR must be 4).
template <int VR, Dt O, bool Z = false>
void vbs_item(const Task& t, const Item& it, void* ws) {
  static_assert(!Z || VR == 4, "the 512-bit scheme has vectors of 4 rows");
  // k per step, steps per k block, words of A per vector and step
  constexpr int64_t KS = Z ? 8 : 16 / VR, KC = kVbsKC / KS, VW = Z ? 16 : 8;
  const int64_t rows = it.m1 - it.m0, cols = it.n1 - it.n0, K = t.k, KQ = ceil_div(K, KS);
  // blk's layout (vbs_block, vbz_block): C^T with 256-bit vectors of 4 rows, else rows of C.
  constexpr bool transposed = VR == 4 && !Z;
  const int64_t ldb = transposed ? round_up(rows, 16) : kVbsSlice;
  const int64_t blk_row = transposed ? 1 : ldb, blk_col = transposed ? ldb : 1;
  constexpr int64_t osz = sizeof(typename Ty<O>::T);
  auto align = [](void* p) { return (float*)(((uintptr_t)p + 63) & ~(uintptr_t)63); };
  uint32_t* ap = (uint32_t*)align(ws);
  float* blk = align(ap + round_up(rows, VR) * KQ * (VW / VR));
  float* bias = align(blk + kVbsSlice * round_up(rows, 16));
  uint16_t* stage = (uint16_t*)align(bias + kVbsSlice);
  const bool staged = vbs_staged(t, rows);
  // Sums to C from the register blocks (vbs_put) rather than through blk and
  // store_block_transposed, which remains for streamed or n-strided outputs. Measured with the
  // next item's rows prefetched (below) and vbs_pack_a's stores spelled out (2 threads, forward,
  // [G, N, K] weights, Dirichlet sizes, one process alternating, caches flushed, 16 rounds,
  // medians, 2026-12-01; vectors of 4 rows), before -> after: G=64, M=2048,
  // K=N=512 3.32 -> 3.17 ms; G=256, M=4096, K=512, N=256 3.99 -> 3.75 ms; Qwen3-30B-A3B /4 2.74 ->
  // 2.53 ms; DeepSeek-V3 /16 2.02 -> 1.89 ms; Mixtral /4 19.36 -> 18.69 ms; OLMoE /2 11.46 ->
  // 11.18 ms; GPT-OSS-20B /4 6.40 -> 6.29 ms; G=8, M=4096, K=1024, N=2048 level. This one alone:
  // 0-4% (G=32, M=2048, K=N=720 6.72 -> 6.47 ms), 2-4% with weights shared by all groups.
  const bool direct = !t.stream && t.c_sn == 1 && K > 0;
  // The next item's rows of A (the rows after this item's: the next group's, or the next rows of
  // this one), into L2 one part per slice, for an item that covers its task's columns (else the
  // next item has the same rows): the packing read them from memory (perf: most of vbs_pack_a's
  // samples after its loads). G=256 with groups of 16: 3.79 -> 3.59 ms; 0-2% elsewhere.
  const bool whole_rows = it.n0 == 0 && it.n1 == t.n;
  PrefetchBlock next_rows(t.a, it.m1 * t.a_sm * 2, whole_rows ? rows : 0, t.a_sm * 2, K * 2, ceil_div(cols, kVbsSlice));
  if constexpr (Z) vbz_pack_a(t, it, ap, KQ);
  else vbs_pack_a<VR>(t, it, ap, KQ);
  const uint16_t* b = (const uint16_t*)t.b;
  for (int64_t ns = 0; ns < cols; ns += kVbsSlice) {
    const int64_t nc = imin(kVbsSlice, cols - ns), col0 = it.n0 + ns;
    load_bias<Dt::bf16>(t, col0, nc, bias, kVbsSlice);
    int64_t calls = 0;  // register blocks in this slice, over which the prefetches are spread
    for (int64_t r0 = 0; r0 < rows; r0 += VR * vbs_vectors<VR>(rows - r0)) {
      calls += vbs_vectors<VR>(rows - r0) == 1 ? ceil_div(nc, 2 * kVbsCols) : ceil_div(nc, kVbsCols);
    }
    calls *= imax(1, ceil_div(KQ, KC));
    // The next slice's rows of W (past the task's end: the next group's, which this thread
    // usually takes next), into L2 while this one computes.
    PrefetchBlock ahead(t.b, (col0 + kVbsSlice) * t.b_sn * 2, kVbsSlice, t.b_sn * 2, K * 2, calls);
    next_rows.take().to_l2();
    warm_pages((const char*)t.b + (col0 + 2 * kVbsSlice) * t.b_sn * 2, kVbsSlice, t.b_sn * 2, K * 2);
    if (K == 0) memset(blk, 0, sizeof(float) * kVbsSlice * round_up(rows, 16));
    for (int64_t q0 = 0; q0 < KQ; q0 += KC) {
      const int64_t kc = imin(KC, KQ - q0), tail = q0 + kc == KQ ? K % KS : 0;
      for (int64_t c0 = 0; c0 < nc; c0 += 2 * kVbsCols) {
        // Rows of W past the task's columns repeat its last one (computed, never stored).
        const uint16_t* w[2 * kVbsCols];
        for (int64_t i = 0; i < 2 * kVbsCols; ++i) w[i] = b + imin(col0 + c0 + i, t.n - 1) * t.b_sn;
        int64_t qw = q0;  // the step of w[i] that is step q0 of the row
        if (staged) {
          const int64_t n = imin(KS * kc, K - KS * q0);
          for (int64_t i = 0; i < 2 * kVbsCols; ++i) {
            uint16_t* d = stage + i * kVbsStageStride;
            for (int64_t e = 0; e < KS * kc; e += 32) {
              _mm512_storeu_si512(d + e, masked_load_epi16x32(e < n ? mask32(n - e) : 0, w[i] + KS * q0 + e));
            }
            w[i] = d;
          }
          qw = 0;
        }
        const bool two = c0 + kVbsCols < nc;
        for (int64_t r0 = 0; r0 < rows;) {
          const int64_t mv = vbs_vectors<VR>(rows - r0);
          const uint32_t* a = ap + (r0 / VR) * KQ * VW + q0 * VW;
          float* bk = blk + r0 * blk_row + c0 * blk_col;
          VbsOut o;
          if (direct && q0 + kc == KQ) {
            o.c = (char*)t.c + ((it.m0 + r0) * t.c_sm + col0 + c0) * osz;
            o.c_sm = t.c_sm;
            o.rows = rows - r0;
            o.cols = nc - c0;
            o.bias = bias + c0;
            o.f32 = O == Dt::f32;
          }
          r0 += mv * VR;
          if (mv == 1) {
            swapped_block<VR, Z, 1, 2 * kVbsCols>(a, KQ * VW, w, qw, kc, tail, q0 == 0, bk, ldb, ahead.take(), o);
            continue;
          }
          for (int h = 0; h < (two ? 2 : 1); ++h) {
            const uint16_t* const* wh = w + h * kVbsCols;
            float* bh = bk + h * kVbsCols * blk_col;
            VbsOut oh = o;
            if (oh.c) {
              oh.c = (char*)oh.c + h * kVbsCols * osz;
              oh.cols -= h * kVbsCols;
              oh.bias += h * kVbsCols;
            }
            if (mv == 3) swapped_block<VR, Z, 3, kVbsCols>(a, KQ * VW, wh, qw, kc, tail, q0 == 0, bh, ldb, ahead.take(), oh);
            else swapped_block<VR, Z, 2, kVbsCols>(a, KQ * VW, wh, qw, kc, tail, q0 == 0, bh, ldb, ahead.take(), oh);
          }
        }
      }
    }
    if (!direct) {
      if constexpr (transposed) store_block_transposed<O>(t, it.m0, col0, blk, ldb, rows, nc, bias);
      else store_block<O>(t, it.m0, col0, blk, ldb, rows, nc, bias);
    }
  }
}

// Groups of 5 to kVbsPairRowsBelow - 1 rows take vectors of 2 rows x 8 k (VR = 2) instead of 4
// rows x 4 k: their rows round up to 2 instead of 4 (equal groups of 13-16 rows took the same
// time with 4, as did 17-20), for the same multiply-adds per load (a 128-bit broadcast of W
// instead of 64-bit), but a block covers 6 rows instead of 12, so W is read from L1 twice as
// often: for every group, 2-4% slower on large ones (G=8, M=4096, K=1024, N=2048 40.9 -> 41.8
// ms, Mixtral /4 18.9 -> 19.6 ms). Chosen by the group's size, never the item's, so that a row's
// summation order does not depend on the cut into items. Measured on the Zen 4 VM (2 threads,
// forward, [G, N, K] weights, one process alternating, caches flushed, 16-20 rounds, medians,
// 2026-12-01), all groups 4 rows x 4 k -> this: G=256, M=4096, K=512, N=256 3.65 -> 3.54 and
// 3.75 -> 3.72 ms (Dirichlet sizes), 3.50 -> 3.44 ms (groups of 16), 3.39 -> 3.08 ms (groups of
// 13); G=64, M=2048, K=N=512 3.31 -> 3.29 / 3.28 ms; Qwen3-30B-A3B /4 2.59 -> 2.53, 2.71 -> 2.66
// ms; GPT-OSS-20B /4 6.50 -> 6.36, 6.54 -> 6.33 ms; DeepSeek-V3 /16, OLMoE /2, G=8 and Mixtral
// /4 level (groups of 1-4 rows on 2-row vectors too then). With the cut at 48 rows: the same
// within the noise. Groups of 3 and 4 rows take them too (since 2026-12-07): one vector of 4 rows
// x 4 k against 16 rows of W loads W 16 times per 16 VDPBF16PS, two vectors of 2 rows x 8 k
// against 8 rows 8 times, and where the weights come from cache that is the time: measured on
// the Zen 4 VM (2 threads, forward, [G, N, K] weights, one process alternating, caches flushed,
// 12-24 rounds, medians, 2026-12-07), one vector of 4 -> two of 2: one weight matrix for all
// groups (in cache), M=4096, K=512, N=256, groups of 4 / 3 rows 5.79 / 6.66 -> 3.88 / 4.73 ms
// (dense 2.80-2.96), G=1024 with Dirichlet sizes 4.96 -> 4.69 ms, G=512, M=2048, K=N=1024 18.22
// -> 17.03 ms; with the weights read (memory-bound) level: groups of 4 9.19 / 8.01 / 38.59 ->
// 9.04 / 8.01 / 39.44 ms (the last at K=1024, N=512), of 3 14.56 -> 14.74 ms, G=1024 Dirichlet
// 8.96 -> 8.97 ms, the issue's G=256 / G=64 forward 4.72 / 3.99 -> 4.77 / 4.04 ms and 5.62 ->
// 5.59 ms; decode (routed as benchmarks/decode.py routes, 16 / 32 tokens) GPT-OSS-20B 16.70 /
// 17.93 -> 16.39 / 18.90 ms, DeepSeek-V3 /4 6.89 / 11.54 -> 6.97 / 11.22 ms (OLMoE, Qwen3-30B-A3B
// and Mixtral: K = 2048 / 4096, so gemv_item). Groups of 1-2 rows keep one vector of 4 rows: with
// vectors of 2, twice as fast from cache (groups of 1 / 2 rows 24.69 / 10.72 -> 15.64 / 6.67 ms)
// but 4.7% slower read (groups of 2: 20.92 -> 21.90 ms) and in decode, which is read: 4 tokens
// GPT-OSS-20B 7.93 -> 8.29 ms, the rest level (as on 2026-12-01: 1 token GPT-OSS-20B 3501-3782
// against 3452-3546 us, three runs each, DeepSeek-V3 /4 level).
constexpr int64_t kVbsPairRowsFrom = 3;
constexpr int64_t kVbsPairRowsBelow = 64;
bool vbs_pair_rows(const Task& t) { return t.m >= kVbsPairRowsFrom && t.m < kVbsPairRowsBelow; }

bool uses_amx(Isa isa, Dt in) { return isa == Isa::amx && in == Dt::bf16; }
bool uses_pairs(Isa isa, Dt in) { return isa == Isa::avx512bf16 && in == Dt::bf16; }
bool uses_swapped(Isa isa, Dt in, const Task& t) {
  return uses_pairs(isa, in) && t.bf16_scheme != kBf16Direct && vbs_task(t);
}

constexpr int64_t kWholeGroup = int64_t(1) << 40;

}  // namespace

int64_t max_item_rows(Isa isa, Dt in, const Task& task) {
  const int64_t k = task.k;
  if (uses_swapped(isa, in, task)) return vbs_item_rows(k);
  // AMX items of any size (amx_item_panels takes those past amx_item_rows): a group is cut
  // into column slices only, so its weights are packed once per call. Measured here (2 threads,
  // G=8, M=4096, K=1024, N=2048, bf16, 20 alternating rounds): rows cut at 512 / 1024 / whole
  // groups, forward 15.9 / 15.6 / 13.8 ms, input gradient 16.8 / 17.6 / 14.2 ms.
  return uses_amx(isa, in) ? kWholeGroup : fma_item_rows(in, k, uses_pairs(isa, in));
}

bool whole_row_items(Isa isa, Dt in, const Task& task) {
  return isa != Isa::generic && in != Dt::f64 && gemvt_task(task, uses_pairs(isa, in));
}

int64_t workspace_bytes(Isa isa, Dt in, const Task& task) {
  const int64_t k = task.k;
  if (uses_amx(isa, in)) return amx_workspace(k);
  if (uses_swapped(isa, in, task)) return vbs_workspace(vbs_item_rows(k), k);
  return fma_workspace(in, k, uses_pairs(isa, in));
}

void thread_begin(Isa isa, Dt in) {
  tl_window_end = 0;
  if (!uses_amx(isa, in)) return;
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = kTileRows;
    cfg.colsb[i] = kTileRowBytes;
  }
  // GCC 12 does not see that ldtilecfg reads the whole struct and drops the stores above
  // without this barrier (the tiles then stay unconfigured: SIGILL on the first tile op).
  __asm__ volatile("" : : "m"(cfg) : "memory");
  tile_config(&cfg);
}

void thread_end(Isa isa, Dt in) {
  // Leaves the tile state as oneDNN expects to find it (it configures tiles itself).
  if (uses_amx(isa, in)) tile_release();
  _mm_sfence();  // non-temporal stores (Task::stream) are visible before the region ends
}

void run_item(Isa isa, Dt in, Dt out, const Task& task, const Item& item, void* ws) {
  if (uses_amx(isa, in)) {
    if (out == Dt::f32) amx_item<Dt::f32>(task, item, ws);
    else amx_item<Dt::bf16>(task, item, ws);
    return;
  }
  switch (in) {
    case Dt::f32: fma_item<VF, Dt::f32, Dt::f32>(task, item, ws); break;
    case Dt::bf16:
      if (uses_pairs(isa, in)) {
        if (uses_swapped(isa, in, task)) {
          const bool pairs = vbs_pair_rows(task);
          if (task.bf16_scheme == kBf16Swapped512) {
            if (out == Dt::f32) vbs_item<4, Dt::f32, true>(task, item, ws);
            else vbs_item<4, Dt::bf16, true>(task, item, ws);
          } else if (out == Dt::f32) {
            pairs ? vbs_item<2, Dt::f32>(task, item, ws) : vbs_item<4, Dt::f32>(task, item, ws);
          } else {
            pairs ? vbs_item<2, Dt::bf16>(task, item, ws) : vbs_item<4, Dt::bf16>(task, item, ws);
          }
        } else if (out == Dt::f32) fma_item<VB, Dt::bf16, Dt::f32>(task, item, ws);
        else fma_item<VB, Dt::bf16, Dt::bf16>(task, item, ws);
      } else if (out == Dt::f32) {
        fma_item<VF, Dt::bf16, Dt::f32>(task, item, ws);
      } else {
        fma_item<VF, Dt::bf16, Dt::bf16>(task, item, ws);
      }
      break;
    case Dt::f16:
      if (out == Dt::f32) fma_item<VF, Dt::f16, Dt::f32>(task, item, ws);
      else fma_item<VF, Dt::f16, Dt::f16>(task, item, ws);
      break;
    case Dt::f64: fma_item<VD, Dt::f64, Dt::f64>(task, item, ws); break;
  }
}

}  // namespace x86
}  // namespace moe_cpu

#endif  // x86_64
