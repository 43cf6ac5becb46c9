// AVX2 kernels of moe_ops' CPU grouped matmul, for x86-64 CPUs with AVX2, FMA and F16C but no
// AVX-512 (AMD Zen 1-3, Intel Haswell to Comet Lake and the client chips since; grouped_mm.cpp
// checks CPUID and the OS first). All four dtypes on 256-bit FMA: fp32, bf16 and fp16 converted
// to fp32 as they are packed and accumulated in fp32, fp64 in fp64.
//
// Why these exist: on such CPUs ATen's CPU matmul has no fast bf16 path. Measured on a 2-core AMD
// EPYC (Zen 2, family 23, model 49) VM, 2026-12-02, torch 2.13.0 (oneDNN 3.12, MKL 2024.2), one
// thread, 512 x 1024 @ 1024 x 512: fp32 torch.mm 48 GFLOP/s (MKL), bf16 torch.mm 1.1 GFLOP/s
// with a row-major right operand and 6.5 GFLOP/s with a transposed one. So bf16 grouped matmuls
// through ATen (the "generic" level, torch._grouped_mm, a loop of torch.mm) run 10-40x slower
// than the same problem in fp32; here bf16 costs what fp32 does, less the bytes.
//
// Like kernels_x86.cpp, this file is compiled with its instruction sets switched on (the pragma
// below), includes only C headers, and keeps everything but the entry points in an anonymous
// namespace, so that none of its code can be picked by the linker for code that runs elsewhere.
//
// Work unit: one Item = rows [m0, m1) x columns [n0, n1) of one Task (C = A @ B + bias). An item
// packs its rows of A once (fp32 / fp64, row-major; for a column-major A, the weight gradient's
// x^T, k-major in panels of kMR rows), then walks its columns in panels of NR = 2 vectors (16
// fp32 or 8 fp64 columns) and K in blocks of kKC, packs each block of B once and multiplies it
// into every row block of kMR = 6 rows: 6 x 2 accumulators (12 of the 16 ymm registers), two
// loads of B and six broadcasts of A per k. Each output element is summed over k in order, in one
// accumulator, so its value does not depend on how the call is cut into items or threads. Every
// element of C in the item is written (k == 0 gives the bias or zeros); C gets one rounding, the
// bias added before it.

#if defined(__x86_64__) || defined(_M_X64)

#pragma GCC target("avx2,fma,f16c")

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

namespace moe_cpu {
namespace avx2 {
namespace {

#include "kernel_common.h"

// Streaming stores, which ASan does not see (kernel_common.h): checked first in a sanitizer build.
inline void stream_ps256(float* p, __m256 v) { check_bytes(p, 32, true); _mm256_stream_ps(p, v); }
inline void stream_pd256(double* p, __m256d v) { check_bytes(p, 32, true); _mm256_stream_pd(p, v); }
inline void stream_si128(void* p, __m128i v) { check_bytes(p, 16, true); _mm_stream_si128((__m128i*)p, v); }
inline void stream_si256(void* p, __m256i v) { check_bytes(p, 32, true); _mm256_stream_si256((__m256i*)p, v); }

// ---------------------------------------------------------------------------------------------
// Vector loads and stores.

// Eight contiguous elements as fp32 (D != f64), or four as fp64 (D == f64): one vector of the
// accumulation type. Whole vectors only; the edges go through `load_part`.
template <Dt D> inline auto load_vec(const typename Ty<D>::T* p);
template <> inline auto load_vec<Dt::f32>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline auto load_vec<Dt::bf16>(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
template <> inline auto load_vec<Dt::f16>(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
template <> inline auto load_vec<Dt::f64>(const double* p) { return _mm256_loadu_pd(p); }

// The accumulation-type vector of a dtype: 8 fp32 or 4 fp64 lanes.
template <Dt D> struct Vec {
  using V = __m256;
  using S = float;
  static constexpr int64_t L = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const S* p) { return _mm256_load_ps(p); }
  static V loadu(const S* p) { return _mm256_loadu_ps(p); }
  static void store(S* p, V v) { _mm256_store_ps(p, v); }
  static V bcast(const S* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
};
template <> struct Vec<Dt::f64> {
  using V = __m256d;
  using S = double;
  static constexpr int64_t L = 4;
  static V zero() { return _mm256_setzero_pd(); }
  static V load(const S* p) { return _mm256_load_pd(p); }
  static V loadu(const S* p) { return _mm256_loadu_pd(p); }
  static void store(S* p, V v) { _mm256_store_pd(p, v); }
  static V bcast(const S* p) { return _mm256_broadcast_sd(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
};

// `count` (at most one vector) elements `step` apart as a vector, zero past them: the edges of
// rows and strided rows, read element by element so that nothing past the last one is touched.
template <Dt D>
inline typename Vec<D>::V load_part(const typename Ty<D>::T* p, int64_t count, int64_t step = 1) {
  alignas(32) typename Vec<D>::S tmp[Vec<D>::L] = {};
  for (int64_t i = 0; i < count; ++i) tmp[i] = Ty<D>::get(p + i * step);
  return Vec<D>::load(tmp);
}

// fp32 -> bf16 bits in the low half of each 32-bit lane, round to nearest even, NaN -> 0x7FC0
// (the scalar rule of Ty<bf16>::put).
inline __m256i f32_to_bf16_lanes(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
}

// fp32 -> 8 bf16.
inline __m128i f32_to_bf16x8(__m256 f) {
  const __m256i r = f32_to_bf16_lanes(f);
  // 32-bit lanes (each < 2^16) to 16-bit: packus works within 128-bit halves.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Two fp32 vectors -> 16 bf16 / fp16 in order, one 256-bit vector.
template <Dt O> inline __m256i f32_to_16bit_x16(__m256 v0, __m256 v1) {
  if constexpr (O == Dt::bf16) {
    // packus interleaves the 128-bit halves: [v0 0-3, v1 0-3, v0 4-7, v1 4-7]; the permute orders them.
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(f32_to_bf16_lanes(v0), f32_to_bf16_lanes(v1)), 0xD8);
  } else {
    return _mm256_set_m128i(_mm256_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT), _mm256_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT));
  }
}

// One accumulation-type vector to `count` elements of dtype O at p, sn apart; non-temporal where
// `stream` and a whole 32-byte-aligned vector allow.
template <Dt O>
inline void put_vec(typename Ty<O>::T* p, int64_t sn, typename Vec<O == Dt::f64 ? Dt::f64 : Dt::f32>::V v,
                    int64_t count, bool stream) {
  constexpr int64_t L = O == Dt::f64 ? 4 : 8;
  if (sn == 1 && count >= L) {
    if constexpr (O == Dt::f32) {
      if (stream && ((uintptr_t)p & 31) == 0) stream_ps256(p, v);
      else _mm256_storeu_ps(p, v);
    } else if constexpr (O == Dt::f64) {
      if (stream && ((uintptr_t)p & 31) == 0) stream_pd256(p, v);
      else _mm256_storeu_pd(p, v);
    } else {
      const __m128i h = O == Dt::bf16 ? f32_to_bf16x8(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
      if (stream && ((uintptr_t)p & 15) == 0) stream_si128(p, h);
      else _mm_storeu_si128((__m128i*)p, h);
    }
    return;
  }
  alignas(32) typename Ty<O>::Acc tmp[L];
  if constexpr (O == Dt::f64) _mm256_store_pd(tmp, v);
  else _mm256_store_ps(tmp, v);
  for (int64_t i = 0; i < imin(L, count); ++i) Ty<O>::put(p + i * sn, tmp[i]);
}

// The bias of columns n0 .. n0 + count - 1 (zeros past them, or all zeros without a bias) as the
// accumulation type, `width` values to dst.
template <Dt D>
void load_bias(const Task& t, int64_t n0, int64_t count, typename Ty<D>::Acc* dst, int64_t width) {
  using T = typename Ty<D>::T;
  for (int64_t j = 0; j < width; ++j) {
    dst[j] = t.bias != nullptr && j < count ? Ty<D>::get((const T*)t.bias + (n0 + j) * t.bias_sn) : 0;
  }
}

// ---------------------------------------------------------------------------------------------
// The blocked kernel.

constexpr int64_t kMR = 6;
// A row count as a type, for the kernels instantiated per row block height.
template <int R> struct Rows {
  static constexpr int value = R;
};
// k per packed block of B: 256 x 16 fp32 = 16 KiB, half of the 32 KiB L1 of Zen 2 / Haswell, so
// that it stays there while the item's row blocks go through it, beside a row block of A
// (6 KiB).
constexpr int64_t kKC = 256;
// Widest slab of n-contiguous B packed at once (kKC rows of it, read in memory order), and the
// most partial sums an item keeps (rows x slab width, fp32 / fp64) across its k blocks.
constexpr int64_t kWideCols = 512;
constexpr int64_t kPartBytes = 128 * 1024;
// A k block of the item's packed rows of A stays within this (L2: 512 KiB per core on Zen 2, 256
// KiB on Haswell; B's blocks and the partial sums share it).
constexpr int64_t kAPackBytes = 192 * 1024;

// While one panel or slab of B computes, the next one's lines are prefetched into L2, spread over
// the kernel calls (PrefetchBlock: a share per call, spread again over its k steps). Without
// them the packs wait for memory: with one weight matrix shared by all groups (in cache) the
// G=64, M=2048, K=N=512 forward ran at 98-108 GFLOP/s on the Zen 2 VM's two cores, with 64
// distinct ones (as in a MoE layer) at ~55. Measured there (2 threads, one process alternating,
// caches flushed between calls, group sizes drawn per call, 12 rounds, medians, 2026-12-02),
// without -> with: G=64, M=2048, K=N=512 forward bf16 12.63 -> 11.14 ms, fp32 14.03 -> 11.75 ms,
// input gradient fp32 14.83 -> 14.19 ms; G=256, M=4096, K=512, N=256 forward bf16 17.81 -> 14.29
// ms, fp32 19.51 -> 15.83 ms, input gradient fp32 18.15 -> 15.77 ms; the bf16 input gradients and
// the weight gradients level.

// acc[i][j] += sum_{k < kc} A(i, k) * b[k * ldb + j*L .. +L) for i < R, j < 2 (b: kc rows of 2
// vectors, ldb apart: NR in a packed panel, or the row stride of B read in place), A(i, k) at
// a + i * lda + k (row-major packed A) or, with KM, a + k * lda + i (k-major: lda = kMR in a
// panel of pack_a). The lines of `pf` are prefetched spread evenly over the k steps, and `drain`
// takes one step per k step (Staged below: the previous panel's results to C).
struct NoDrain {
  void step() {}
};
template <class VT, int R, bool KM, class Drain = NoDrain>
inline void block_kernel(const typename VT::S* a, int64_t lda, const typename VT::S* b, int64_t ldb, int64_t kc,
                         typename VT::V (&acc)[kMR][2], PfRun pf, Drain&& drain = NoDrain{}) {
  using V = typename VT::V;
  const int64_t every = pf.lines > 0 ? imax(1, kc / pf.lines) : kc, per = pf.lines > kc ? ceil_div(pf.lines, kc) : 1;
  for (int64_t k = 0; k < kc;) {
    for (int64_t q = 0; q < per && pf.lines > 0; ++q, --pf.lines, pf.first += 64) _mm_prefetch(pf.first, _MM_HINT_T1);
    const int64_t end = imin(kc, k + every);
#pragma GCC unroll 4
    for (; k < end; ++k) {
      drain.step();
      const V b0 = VT::loadu(b + k * ldb), b1 = VT::loadu(b + k * ldb + VT::L);
#pragma GCC unroll 6
      for (int i = 0; i < R; ++i) {
        const V av = VT::bcast(KM ? a + k * lda + i : a + i * lda + k);
        acc[i][0] = VT::fma(av, b0, acc[i][0]);
        acc[i][1] = VT::fma(av, b1, acc[i][1]);
      }
    }
  }
}

// Whether every row of C from c, sm elements apart, starts on a 32-byte boundary: where a row of
// a panel can go out as whole 32-byte streaming stores.
template <class TO> inline bool rows_aligned32(const TO* c, int64_t sm) {
  return (((uintptr_t)c | (uintptr_t)(sm * (int64_t)sizeof(TO))) & 31) == 0;
}

// Accumulators of R rows x nc (<= 2 vectors) columns plus the bias to C from (row0, col0), with
// the one rounding. C's fields are read once: the vector stores alias everything, so the compiler
// would reload them per row. Inlined always: out of line, the accumulators it takes by reference
// live on the stack, stored there every k step (the G=64 forward 15% slower).
template <Dt O, class VT, int R>
__attribute__((always_inline)) inline void store_rows(const Task& t, int64_t row0, int64_t col0, int64_t nc,
                                                      typename VT::V (&acc)[kMR][2], const typename VT::S* bias) {
  using TO = typename Ty<O>::T;
  const int64_t sm = t.c_sm, sn = t.c_sn;
  const bool stream = t.stream;
  TO* c = (TO*)t.c + row0 * sm + col0 * sn;
  const typename VT::V bias0 = VT::load(bias), bias1 = VT::load(bias + VT::L);
  if constexpr (O == Dt::bf16 || O == Dt::f16) {
    // A whole row of the panel as one 32-byte store, rounded and packed two vectors at a time
    // (instead of two 16-byte stores through put_vec). It matters where K is short: measured on
    // the Zen 2 VM (as for rows_strip, 16 rounds), weight gradient bf16 G=256, M=4096, K=512,
    // N=256 17.87 -> 15.14 ms, G=64, M=2048, K=N=512 13.47 -> 12.24 ms; G=8 and the forwards and
    // input gradients level.
    if (sn == 1 && nc == 2 * VT::L) {
      const bool nt = stream && rows_aligned32(c, sm);
#pragma GCC unroll 6
      for (int i = 0; i < R; ++i) {
        const __m256i h = f32_to_16bit_x16<O>(VT::add(acc[i][0], bias0), VT::add(acc[i][1], bias1));
        if (nt) stream_si256(c + i * sm, h);
        else _mm256_storeu_si256((__m256i*)(c + i * sm), h);
      }
      return;
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    put_vec<O>(c + i * sm, sn, VT::add(acc[i][0], bias0), nc, stream);
    if (nc > VT::L) put_vec<O>(c + i * sm + VT::L * sn, sn, VT::add(acc[i][1], bias1), nc - VT::L, stream);
  }
}

// One row block (R rows from row0) x one panel (nc <= NR columns from col0; kc rows ldb apart
// at b) over one k block: the accumulators start at zero (first) or from `part`, and end in C
// (last, with the bias and the one rounding) or in `part`. Out of line so that each R gets its
// own register allocation.
template <Dt D, Dt O, int R, bool KM>
__attribute__((noinline)) void rows_block(const Task& t, int64_t row0, int64_t col0, int64_t nc,
                                          const typename Vec<D>::S* a, int64_t lda, const typename Vec<D>::S* b,
                                          int64_t ldb, int64_t kc, bool first, bool last, typename Vec<D>::S* part,
                                          const typename Vec<D>::S* bias, PfRun pf) {
  using VT = Vec<D>;
  constexpr int64_t NR = 2 * VT::L;
  typename VT::V acc[kMR][2];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    acc[i][0] = first ? VT::zero() : VT::load(part + i * NR);
    acc[i][1] = first ? VT::zero() : VT::load(part + i * NR + VT::L);
  }
  block_kernel<VT, R, KM>(a, lda, b, ldb, kc, acc, pf);
  if (!last) {
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      VT::store(part + i * NR, acc[i][0]);
      VT::store(part + i * NR + VT::L, acc[i][1]);
    }
    return;
  }
  store_rows<O, VT, R>(t, row0, col0, nc, acc, bias);
}

// A row block's results for one panel (R rows x 64 bytes: NR fp32 / fp64 values, or 32 bytes of
// 16-bit ones), held in L1 and streamed to C one 32-byte vector per k step of the next panel's
// kernel, instead of 2R non-temporal stores at once after each panel. Where K is a group's tokens
// (the weight gradient) a panel is a few hundred cycles and its output lines are written at
// about the rate memory takes them; stored in a burst, the stores stalled the FMAs behind them
// rather than draining beside them. Measured on a Zen 3 VM (AMD EPYC, family 25, model 1, AVX2,
// 2026-12-06; 2 threads, one process per variant, alternating, caches flushed, group sizes drawn
// per call, 10 rounds, medians, two runs each), weight gradient fp32, burst -> staged: G=64,
// M=2048, K=N=512 10.89 / 10.97 -> 9.06 / 10.38 ms; G=256, M=4096, K=512, N=256 11.26 / 10.74
// -> 10.41 / 9.90 ms; OLMoE /2 (G=64, M=4096, K=1024, N=512) 34.6 / 34.0 -> 30.3 / 28.9 ms;
// GPT-OSS /4 14.2-15.0 -> 13.9-14.2 ms; Qwen3 /4 and DeepSeek /16 (N = 192, 128) level. bf16
// (half the bytes): G=64 10.9 / 11.0 -> 10.4 / 10.3 ms, G=256 and Qwen3 /4 level or 1-6% faster.
// Timed apart at G=256 (scratch build), the FMAs alone took 6.9 ms and the stores alone ~8 ms:
// the 9.4-10.4 ms of both together are still well above the larger of the two.
struct Staged {
  alignas(64) uint8_t buf[kMR * 64];
  char* dst[kMR * 2];
  int n = 0, i = 0;
  void step() {
    if (i < n) {
      stream_si256(dst[i], _mm256_load_si256((const __m256i*)(buf + 32 * i)));
      ++i;
    }
  }
  void flush() {
    while (i < n) step();
  }
  // The accumulators plus the bias, rounded to O, into buf; row i of C at c + i * sm.
  template <Dt O, class VT, int R>
  __attribute__((always_inline)) void put(typename Ty<O>::T* c, int64_t sm, typename VT::V (&acc)[kMR][2],
                                          const typename VT::S* bias) {
    const typename VT::V bias0 = VT::load(bias), bias1 = VT::load(bias + VT::L);
    n = i = 0;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      if constexpr (O == Dt::bf16 || O == Dt::f16) {
        _mm256_store_si256((__m256i*)(buf + 32 * n), f32_to_16bit_x16<O>(VT::add(acc[r][0], bias0), VT::add(acc[r][1], bias1)));
        dst[n++] = (char*)(c + r * sm);
      } else {
        VT::store((typename VT::S*)(buf + 32 * n), VT::add(acc[r][0], bias0));
        dst[n++] = (char*)(c + r * sm);
        VT::store((typename VT::S*)(buf + 32 * n), VT::add(acc[r][1], bias1));
        dst[n++] = (char*)(c + r * sm + VT::L);
      }
    }
  }
};

// One row block (R rows from row0) x a whole slab of wc columns from col0 (panels of kc rows x NR
// at b, kc <= kKC: all of K) to C, panel by panel in one call. With a short K (the weight
// gradient's K is a group's tokens, ~16 at G=256) a panel is a few hundred cycles, and the call
// per panel of rows_block cost: measured on the Zen 2 VM (2 threads, one process alternating,
// caches flushed, group sizes drawn per call, 12 rounds, medians, 2026-12-02), a call per panel
// -> per row block, weight gradient G=256, M=4096, K=512, N=256 fp32 16.85 -> 14.31 ms, bf16
// 20.07 -> 17.06 ms; G=64, M=2048, K=N=512 fp32 13.05 -> 11.90 ms, bf16 18.57 -> 16.51 ms.
template <Dt D, Dt O, int R, bool KM>
__attribute__((noinline)) void rows_strip(const Task& t, int64_t row0, int64_t col0, int64_t wc,
                                          const typename Vec<D>::S* a, int64_t lda, const typename Vec<D>::S* b,
                                          int64_t kc, const typename Vec<D>::S* bias, PrefetchBlock& ahead) {
  using VT = Vec<D>;
  using TO = typename Ty<O>::T;
  constexpr int64_t NR = 2 * VT::L;
  TO* c = (TO*)t.c + row0 * t.c_sm + col0 * t.c_sn;
  const bool stage = t.stream && t.c_sn == 1 && rows_aligned32(c, t.c_sm);
  Staged st;
  for (int64_t j = 0; j < wc; j += NR) {
    typename VT::V acc[kMR][2];
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = VT::zero();
    if (stage) {
      block_kernel<VT, R, KM>(a, lda, b + j * kc, NR, kc, acc, ahead.take(), st);
      st.flush();
      if (j + NR <= wc) {
        st.put<O, VT, R>(c + j, t.c_sm, acc, bias + j);
        continue;
      }
    } else {
      block_kernel<VT, R, KM>(a, lda, b + j * kc, NR, kc, acc, ahead.take());
    }
    store_rows<O, VT, R>(t, row0, col0 + j, imin(NR, wc - j), acc, bias + j);
  }
  st.flush();
}

// The item's rows of A, converted to the accumulation type: row-major, row r at dst + r * lda
// (k < K); or, where the rows are the contiguous dimension (kmajor: a_sm == 1), k-major in
// panels of kMR rows, lda k each: element (r, k) at dst + (r - r % kMR) * lda + k * kMR + r % kMR,
// so that a row block's kMR values of one k are adjacent and its k steps one contiguous run.
// (The item's rows k-major in one array instead, lda = rows + a line or two apart, made the row
// block read one line per k step, 0.8 KiB apart at 192 rows: measured on the Zen 3 VM (AMD EPYC,
// family 25, model 1, 2026-12-07; 2 threads, both layouts switched call by call in one process,
// caches flushed, group sizes drawn per call, 10-24 rounds, medians), one array -> panels, weight
// gradient with groups of more than kKC tokens: fp32 G=8, M=4096, K=1024, N=2048 178 / 173 / 181
// / 155 -> 150 / 166 / 167 / 139 ms; G=16, M=8192, K=N=1024 143 -> 130 ms; bf16 165 -> 141 and
// 148 -> 137 ms; G=64 and G=256 (groups of ~32 and ~16 tokens: one k block) level.)
template <Dt D>
void pack_a(const Task& t, const Item& it, typename Vec<D>::S* dst, int64_t lda, bool kmajor) {
  using T = typename Ty<D>::T;
  using S = typename Vec<D>::S;
  constexpr int64_t L = Vec<D>::L;
  const int64_t rows = it.m1 - it.m0, K = t.k;
  const T* a = (const T*)t.a + it.m0 * t.a_sm;
  if (kmajor) {
    for (int64_t k = 0; k < K; ++k) {
      const T* src = a + k * t.a_sk;
      for (int64_t mb = 0; mb < rows; mb += kMR) {
        S* out = dst + mb * lda + k * kMR;
        if constexpr (L == 8) {
          if (mb + L <= rows) {  // 8 rows read, 6 stored
            const __m256 v = load_vec<D>(src + mb);
            _mm_storeu_ps(out, _mm256_castps256_ps128(v));
            _mm_storel_pi((__m64*)(out + 4), _mm256_extractf128_ps(v, 1));
            continue;
          }
        }
        for (int64_t i = 0; i < imin(kMR, rows - mb); ++i) out[i] = Ty<D>::get(src + mb + i);
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = a + r * t.a_sm;
    S* out = dst + r * lda;
    int64_t k = 0;
    if (t.a_sk == 1) {
      for (; k + L <= K; k += L) Vec<D>::store(out + k, load_vec<D>(src + k));
    }
    for (; k < K; ++k) out[k] = Ty<D>::get(src + k * t.a_sk);
  }
}

// 8 x 8 fp32 transpose in registers: r[i] lane j <- r[j] lane i.
inline void transpose8(__m256 r[8]) {
  __m256 u[8], v[8];
  for (int i = 0; i < 8; i += 2) {
    u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    v[i] = _mm256_shuffle_ps(u[i], u[i + 2], 0x44);
    v[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], 0xEE);
    v[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0x44);
    v[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(v[i], v[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(v[i], v[i + 4], 0x31);
  }
}

// A panel of k-contiguous B (b_sk == 1): columns n0 .. n0 + nc - 1 (nc <= NR) for k0 .. k0 + kc - 1,
// to dst as kc rows of NR values (zeros past nc). Each column is a contiguous run of k, read in
// memory order; fp32 blocks of 8 k x 8 columns are transposed in registers.
template <Dt D>
void pack_b_kcontig(const Task& t, int64_t k0, int64_t kc, int64_t n0, int64_t nc, typename Vec<D>::S* dst) {
  using T = typename Ty<D>::T;
  using S = typename Vec<D>::S;
  constexpr int64_t NR = 2 * Vec<D>::L;
  const T* b = (const T*)t.b + n0 * t.b_sn + k0;
  int64_t k = 0;
  if constexpr (D != Dt::f64) {
    if (nc == NR) {
      for (; k + 8 <= kc; k += 8) {
        for (int h = 0; h < 2; ++h) {
          __m256 r[8];
          for (int j = 0; j < 8; ++j) r[j] = load_vec<D>(b + (h * 8 + j) * t.b_sn + k);
          transpose8(r);
          for (int q = 0; q < 8; ++q) _mm256_store_ps(dst + (k + q) * NR + h * 8, r[q]);
        }
      }
    }
  }
  for (int64_t j = 0; j < NR; ++j) {
    for (int64_t q = k; q < kc; ++q) dst[q * NR + j] = j < nc ? (S)Ty<D>::get(b + j * t.b_sn + q) : (S)0;
  }
}

// A slab of B with any strides: rows k0 .. k0 + kc - 1, columns n0 .. n0 + wc - 1, as ceil(wc / NR)
// panels of kc rows x NR values (zeros past wc), panel p at dst + p * kc * NR. With n-contiguous
// rows (b_sn == 1) each row is read once in memory order across the slab.
template <Dt D>
void pack_b_slab(const Task& t, int64_t k0, int64_t kc, int64_t n0, int64_t wc, typename Vec<D>::S* dst) {
  using T = typename Ty<D>::T;
  using VT = Vec<D>;
  constexpr int64_t L = VT::L, NR = 2 * L;
  const int64_t panels = ceil_div(wc, NR);
  for (int64_t k = 0; k < kc; ++k) {
    const T* row = (const T*)t.b + (k0 + k) * t.b_sk + n0 * t.b_sn;
    for (int64_t p = 0; p < panels; ++p) {
      typename VT::S* out = dst + p * kc * NR + k * NR;
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t j = p * NR + h * L, count = imin(L, wc - j);
        VT::store(out + h * L, t.b_sn == 1 && count == L ? load_vec<D>(row + j)
                                                         : load_part<D>(row + j * t.b_sn, count, t.b_sn));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Groups of one to eight rows (decode: a token sends one row to each of its top-k experts). The
// blocked kernel would pack every element of the weights for a few multiply-adds; these
// read the weights in place, once, in memory order. Chosen by the group's size (never the
// item's), so that a group's summation order does not depend on how the call is cut. Measured
// on the Zen 2 VM (benchmarks/decode.py's models, one token, experts routed anew every call, 2
// threads, one process alternating, 15 rounds, 2026-12-02), blocked kernel -> these, [G, N, K]
// weights: bf16 Mixtral /2 6.28 -> 2.11 ms, GPT-OSS-20B 6.39 -> 2.63, OLMoE-1B-7B 4.54 -> 1.44,
// Qwen3-30B-A3B 3.95 -> 1.24, DeepSeek-V3 /4 1.51 -> 0.68 ms; fp32 1.5-1.9x; [G, K, N] weights
// (before the prefetch and the wider passes below): 1.5-2.9x.

// Rows 5-8 in a second pass (gemv_rows, gemvt_rows). Measured as above, groups of up to 4 ->
// up to 8 rows on these kernels, Dirichlet sizes, input gradient bf16: G=256, M=4096, K=512,
// N=256 12.90 -> 12.37 ms; M=1536 (groups of 6 on average) 7.37 -> 6.97 ms; M=2048 8.63 -> 8.41
// ms; G=128, M=8192, K=2048, N=768 311 -> 303 ms; the forwards 0-4% faster, fp32 level.
constexpr int64_t kGemvRows = 8;
// Rows of W ahead that gemv_block prefetches (the next block's), one line per line it reads.
constexpr int64_t kGemvAheadRows = 4;
// Columns of one pass of gemvt over W's rows (its sums: up to kGemvRows x this fp32, 256 KiB, in
// L2), so that the rows of the widest experts are read whole, front to back. Measured on the
// Zen 2 VM (benchmarks/decode.py's [G, K, N] cases, 2 threads, one process alternating, 15
// rounds, 2026-12-02), 2048 -> 16384 columns, one / four tokens: bf16 Mixtral /2 (N = 7168)
// 4.75 / 9.77 -> 3.16 / 7.48 ms, GPT-OSS-20B (N = 2880) 4.44 / 15.3 -> 3.06 / 11.6 ms, fp32
// 7.00 / 18.3 -> 6.00 / 15.3 and 7.14 / 27.3 -> 5.62 / 22.4 ms; N <= 2048 level. (Eight rows
// of W per pass over the sums instead of four: 5-40% slower; the prefetches into L1, or twice as
// far ahead: level.)
constexpr int64_t kGemvtCols = 16384;
// Rows further on that gemvt prefetches: at least this far ahead. Measured (same method, [G, K,
// N], one token, 2048 columns a pass) without -> with: bf16 Mixtral /2 4.75 -> 4.31 ms, OLMoE
// 3.98 -> 2.88, Qwen3-30B-A3B 3.17 -> 2.56, fp32 1.1-1.15x.
constexpr int64_t kGemvtAheadBytes = 16 * 1024;

float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// The item's rows of A as fp32, lda apart, zero from K to lda.
template <Dt D>
float* gemv_pack_rows(const Task& t, const Item& it, void* ws, int64_t lda) {
  using T = typename Ty<D>::T;
  float* ap = (float*)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
  for (int64_t r = 0; r < it.m1 - it.m0; ++r) {
    const T* a = (const T*)t.a + (it.m0 + r) * t.a_sm;
    for (int64_t k = 0; k < lda; ++k) ap[r * lda + k] = k < t.k ? Ty<D>::get(a + k * t.a_sk) : 0.0f;
  }
  return ap;
}

// k-contiguous weights (W [G, N, K] viewed as [G, K, N], the forward): C[m, n] = A[m, :] . W[n, :]
// for NJ rows of W from n, R rows of A; fp32 lanes summed once at the end.
template <Dt D, Dt O, int R, int NJ>
void gemv_block(const Task& t, const Item& it, const float* ap, int64_t lda, int64_t n, const float* bias) {
  using T = typename Ty<D>::T;
  const int64_t K = t.k;
  const T* w = (const T*)t.b + n * t.b_sn;
  __m256 acc[NJ][R];
  for (int j = 0; j < NJ; ++j) {
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  }
  auto step = [&](int64_t k, const __m256 (&wv)[NJ]) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_load_ps(ap + r * lda + k);
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) acc[j][r] = _mm256_fmadd_ps(wv[j], av, acc[j][r]);
    }
  };
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (((k * (int64_t)sizeof(T)) & 63) == 0) {  // the next block's rows (a prefetch never faults)
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) _mm_prefetch((const char*)(w + (j + kGemvAheadRows) * t.b_sn + k), _MM_HINT_T1);
    }
    __m256 wv[NJ];
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) wv[j] = load_vec<D>(w + j * t.b_sn + k);
    step(k, wv);
  }
  if (k < K) {
    __m256 wv[NJ];
    for (int j = 0; j < NJ; ++j) wv[j] = load_part<D>(w + j * t.b_sn + k, K - k);
    step(k, wv);
  }
  using TO = typename Ty<O>::T;
  for (int r = 0; r < R; ++r) {
    TO* c = (TO*)t.c + (it.m0 + r) * t.c_sm;
    for (int j = 0; j < NJ; ++j) Ty<O>::put(c + (n + j) * t.c_sn, hsum(acc[j][r]) + bias[j]);
  }
}

template <Dt D, Dt O, int R>
void gemv_rows(const Task& t, const Item& it, const float* ap, int64_t lda) {
  // Four rows of W side by side with up to two rows of A, two with more (the accumulators and
  // the rows of W in 16 registers); rows 4-7 of A in a second pass over the same rows of W,
  // still in L1.
  constexpr int R0 = R > 4 ? 4 : R, R1 = R - R0, NJ = R0 <= 2 ? 4 : 2;
  Item hi = it;
  hi.m0 += R0;
  alignas(32) float bias[8];
  for (int64_t n = it.n0; n < it.n1;) {
    const int64_t nj = it.n1 - n >= NJ ? NJ : 1;
    load_bias<D>(t, n, nj, bias, 8);
    if (nj == NJ) {
      gemv_block<D, O, R0, NJ>(t, it, ap, lda, n, bias);
      if constexpr (R1 > 0) gemv_block<D, O, R1, NJ>(t, hi, ap + R0 * lda, lda, n, bias);
    } else {
      gemv_block<D, O, R0, 1>(t, it, ap, lda, n, bias);
      if constexpr (R1 > 0) gemv_block<D, O, R1, 1>(t, hi, ap + R0 * lda, lda, n, bias);
    }
    n += nj;
  }
}

template <Dt D, Dt O>
void gemv_item(const Task& t, const Item& it, void* ws) {
  const int64_t lda = round_up(imax(t.k, 1), 8);
  const float* ap = gemv_pack_rows<D>(t, it, ws, lda);
  switch (it.m1 - it.m0) {
    case 8: gemv_rows<D, O, 8>(t, it, ap, lda); break;
    case 7: gemv_rows<D, O, 7>(t, it, ap, lda); break;
    case 6: gemv_rows<D, O, 6>(t, it, ap, lda); break;
    case 5: gemv_rows<D, O, 5>(t, it, ap, lda); break;
    case 4: gemv_rows<D, O, 4>(t, it, ap, lda); break;
    case 3: gemv_rows<D, O, 3>(t, it, ap, lda); break;
    case 2: gemv_rows<D, O, 2>(t, it, ap, lda); break;
    default: gemv_rows<D, O, 1>(t, it, ap, lda); break;
  }
}

// n-contiguous weights (W [G, K, N], the input gradient's): C[m, :] = sum over k of A[m, k] *
// W[k, :], rows of W read in memory order, four side by side, scaled and added into fp32 sums y
// of the item's rows. Each output element sums its k in order, as the blocked kernel does (the
// results are the same bit for bit).
template <Dt D, int R, int KB>
inline void gemvt_rows_into(const Task& t, const float* ap, int64_t lda, const typename Ty<D>::T* b, int64_t k0,
                            int64_t nc, float* y, int64_t ldy) {
  using T = typename Ty<D>::T;
  const T* row[KB];
  for (int q = 0; q < KB; ++q) row[q] = b + (k0 + q) * t.b_sk;
  // Rows further on into L2, one line per line read, at least kGemvtAheadBytes ahead: the rows
  // are short runs (a few KiB) that the hardware prefetchers would enter late.
  const int64_t ahead_rows = imax(KB, kGemvtAheadBytes / imax(nc * (int64_t)sizeof(T), 1));
  const char* ahead = (const char*)(b + (k0 + KB + ahead_rows) * t.b_sk);  // a prefetch never faults
  for (int64_t j = 0; j < nc; j += 8) {
    if (((j * (int64_t)sizeof(T)) & 63) == 0) {
#pragma GCC unroll 4
      for (int q = 0; q < KB; ++q) _mm_prefetch(ahead + (q * t.b_sk + j) * (int64_t)sizeof(T), _MM_HINT_T1);
    }
    __m256 bv[KB];
    if (j + 8 <= nc) {
#pragma GCC unroll 4
      for (int q = 0; q < KB; ++q) bv[q] = load_vec<D>(row[q] + j);
    } else {
      for (int q = 0; q < KB; ++q) bv[q] = load_part<D>(row[q] + j, nc - j);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float* yp = y + r * ldy + j;
      __m256 acc = _mm256_load_ps(yp);
#pragma GCC unroll 4
      for (int q = 0; q < KB; ++q) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(ap + r * lda + k0 + q), bv[q], acc);
      _mm256_store_ps(yp, acc);
    }
  }
}

template <Dt D, Dt O, int R>
void gemvt_rows(const Task& t, const Item& it, const float* ap, int64_t lda, float* y) {
  using TO = typename Ty<O>::T;
  alignas(32) float bias[8];
  constexpr int64_t cols = kGemvtCols * 4 / (R > 4 ? R : 4) / 8 * 8;
  for (int64_t n0 = it.n0; n0 < it.n1; n0 += cols) {
    const int64_t nc = imin(cols, it.n1 - n0), ldy = round_up(nc, 8);
    for (int64_t i = 0; i < R * ldy; i += 8) _mm256_store_ps(y + i, _mm256_setzero_ps());
    const auto* b = (const typename Ty<D>::T*)t.b + n0;
    int64_t k = 0;
    for (; k + 4 <= t.k; k += 4) gemvt_rows_into<D, R, 4>(t, ap, lda, b, k, nc, y, ldy);
    for (; k < t.k; ++k) gemvt_rows_into<D, R, 1>(t, ap, lda, b, k, nc, y, ldy);
    for (int64_t j = 0; j < nc; j += 8) {
      load_bias<D>(t, n0 + j, imin(8, nc - j), bias, 8);
      const __m256 bv = _mm256_load_ps(bias);
      for (int64_t r = 0; r < R; ++r) {
        TO* c = (TO*)t.c + (it.m0 + r) * t.c_sm + (n0 + j) * t.c_sn;
        put_vec<O>(c, t.c_sn, _mm256_add_ps(_mm256_load_ps(y + r * ldy + j), bv), nc - j, false);
      }
    }
  }
}

template <Dt D, Dt O>
void gemvt_item(const Task& t, const Item& it, void* ws) {
  const int64_t lda = round_up(imax(t.k, 1), 8);
  const float* ap = gemv_pack_rows<D>(t, it, ws, lda);
  float* y = (float*)(((uintptr_t)(ap + kGemvRows * lda) + 63) & ~(uintptr_t)63);
  switch (it.m1 - it.m0) {
    case 8: gemvt_rows<D, O, 8>(t, it, ap, lda, y); break;
    case 7: gemvt_rows<D, O, 7>(t, it, ap, lda, y); break;
    case 6: gemvt_rows<D, O, 6>(t, it, ap, lda, y); break;
    case 5: gemvt_rows<D, O, 5>(t, it, ap, lda, y); break;
    case 4: gemvt_rows<D, O, 4>(t, it, ap, lda, y); break;
    case 3: gemvt_rows<D, O, 3>(t, it, ap, lda, y); break;
    case 2: gemvt_rows<D, O, 2>(t, it, ap, lda, y); break;
    default: gemvt_rows<D, O, 1>(t, it, ap, lda, y); break;
  }
}

// Which decode kernel a task takes, if any: 1 gemv (k-contiguous W), 2 gemvt (n-contiguous W).
int gemv_kind(const Task& t) {
  if (t.m > kGemvRows) return 0;
  if (t.b_sk == 1 && t.b_sn != 1) return 1;
  if (t.b_sn == 1 && t.b_sk != 1) return 2;
  return 0;
}

// Rows of one item: a k block of its packed rows of A (rows x kKC) within kAPackBytes (6 .. 240,
// a multiple of kMR). Each item packs its own blocks of B, so the more rows an item has, the
// fewer times a large group's weights are read. Capped by the whole of A (rows x K) instead, as
// first written, G=8 groups of ~512 rows with K = 1024 took items of 42 rows and read their
// weights 12 times. Measured on the Zen 2 VM (2 threads, one process alternating, caches
// flushed, group sizes drawn per call, 8 rounds, medians, 2026-12-02), rows x K -> rows x kKC:
// G=8, M=4096, K=1024, N=2048 forward bf16 134 -> 118 ms, fp32 139 -> 121 ms, input gradient fp32
// 155 -> 125 ms, weight gradient fp32 182 -> 129 ms (dense fp32 138-164 ms); Mixtral /2 (G=8,
// M=2048, K=4096, N=7168) forward 1874 -> 998 ms bf16, 1829 -> 856 ms fp32; G=128, M=8192,
// K=2048, N=768 forward fp32 506 -> 370 ms, input gradient 389 -> 243 ms; G=64 and G=256 level.
int64_t item_rows(Dt in, int64_t K) {
  const int64_t bytes = (in == Dt::f64 ? 8 : 4) * imax(imin(K, kKC), 1);
  return imax(kMR, imin(240, kAPackBytes / bytes / kMR * kMR));
}

// lda of packed A (pack_a): row-major, the distance between rows: one line more than K, so that
// rows do not fall into the same L1 sets; k-major, the k of a panel: K rounded up to 8, so that
// every panel (kMR x 8 values: 192 or 384 bytes a step) starts on a line. Either way the item's
// packed rows take rows (rounded up to kMR) x lda values.
int64_t a_ld(int64_t K, bool kmajor, int64_t s) {
  const int64_t per_line = 64 / s;
  return kmajor ? round_up(imax(K, 1), 8) : round_up(imax(K, 1), per_line) + per_line;
}

bool kmajor_a(const Task& t) { return t.a_sm == 1 && t.a_sk != 1; }

int64_t workspace(Dt in, int64_t K) {
  const int64_t s = in == Dt::f64 ? 8 : 4, rows = round_up(item_rows(in, K), kMR), NR = 64 / s;
  const int64_t a = rows * imax(a_ld(K, false, s), a_ld(K, true, s));
  const int64_t b = imax(kKC * kWideCols, imax(K, 1) * NR);
  const int64_t gemv = (kGemvRows * round_up(imax(K, 1), 8) + 4 * kGemvtCols) * 4 + 128;
  return imax(gemv, (a + b + kWideCols) * s + kPartBytes + 4 * 64);
}

// Whether the panels of n-contiguous B go to the kernel where they lie (kc rows b_sk apart)
// instead of being copied into the packed slab first: fp32 / fp64 B (nothing to convert) whose
// rows are apart by a distance that spreads a panel's kKC lines over at least 64 of the 1024
// sets of a 512 KiB, 8-way L2 (Zen 2 / Zen 3), i.e. 512 lines for its 256: not a multiple of 64
// bytes, or a multiple whose power-of-two factor is at most 1 KiB. Such a panel stays in L2
// while each row block of the item reads it again (its rows fall into few L1 sets, so it does
// not stay in L1; L2 keeps up with the kernel's 64 bytes per k step), and the copy is gone: at
// G=256 (groups of ~16 rows, each packed panel read three times) it took ~25% of the op's
// samples. Rows 2, 4 or 8 KiB apart (N = 512, 1024, 2048 fp32) map to at most 32 sets, which
// the panel and everything else contend for: read in place regardless, G=8, M=4096, K=1024,
// N=2048 went 142 -> 164 ms, and G=64, M=2048, K=N=512 stayed level. Measured on the Zen 3 VM
// (AMD EPYC, family 25, model 1, 2026-12-07; 2 threads, both ways switched call by call in one
// process with dense torch.mm between, 64 MiB read between calls, group sizes drawn per call,
// 8-10 rounds, medians of two runs each), packed -> in place, input gradient fp32: G=256,
// M=4096, K=512, N=256 17.25 / 14.26 -> 15.24 / 13.23 ms; G=128, M=8192, K=2048, N=768 289 / 222
// -> 251 / 212 ms; GPT-OSS-20B /4 (G=32, M=2048, K=N=720) 19.95 / 18.74 -> 18.17 / 17.35 ms;
// Qwen3-30B-A3B /4 (G=128, M=4096, K=512, N=192) 8.44 / 7.46 -> 7.97 / 7.48 ms; DeepSeek-V3 /16
// (G=256, M=4096, K=448, N=128) 6.51 / 5.97 -> 6.61 / 6.02 ms; fp64 (one run, 8 rounds) G=256
// 29.7 -> 28.9 ms, GPT-OSS-20B /4 48.5 -> 42.9 ms.
template <Dt D> bool b_in_place(const Task& t) {
  if constexpr (D != Dt::f32 && D != Dt::f64) return false;
  const int64_t stride = t.b_sk * (int64_t)sizeof(typename Ty<D>::T);
  if (t.b_sn != 1 || stride <= 0) return false;
  if (stride % 64 != 0) return true;
  const int64_t lines = stride / 64;
  return (lines & -lines) <= 16;  // kKC rows this far apart fall into 1024 / (lines & -lines) sets
}

template <Dt D, Dt O>
void item(const Task& t, const Item& it, void* ws) {
  if constexpr (D != Dt::f64) {
    const int kind = gemv_kind(t);
    if (kind == 1) return gemv_item<D, O>(t, it, ws);
    if (kind == 2) return gemvt_item<D, O>(t, it, ws);
  }
  using VT = Vec<D>;
  using S = typename VT::S;
  constexpr int64_t NR = 2 * VT::L;
  const int64_t rows = it.m1 - it.m0, cols = it.n1 - it.n0, K = t.k, rows_p = round_up(rows, kMR);
  const bool kmajor = kmajor_a(t);
  const int64_t lda = a_ld(K, kmajor, sizeof(S));
  auto align = [](S* p) { return (S*)(((uintptr_t)p + 63) & ~(uintptr_t)63); };
  S* ap = align((S*)ws);
  S* bp = align(ap + rows_p * lda);
  S* bias = align(bp + imax(kKC * kWideCols, imax(K, 1) * NR));
  S* part = align(bias + kWideCols);
  pack_a<D>(t, it, ap, lda, kmajor);

  const int64_t row_blocks = ceil_div(rows, kMR), k_blocks = imax(1, ceil_div(K, kKC)), esz = sizeof(typename Ty<D>::T);
  // Calls f(Rows<R>{}, a, row0) for the row block from row mb of the item (R = its rows, 1 .. kMR;
  // a: its packed rows of A from k0), each R its own instantiation of the kernels.
  auto rows_of = [&](int64_t mb, int64_t k0, auto&& f) {
    const S* a = ap + mb * lda + k0 * (kmajor ? kMR : 1);
    const int64_t row0 = it.m0 + mb;
    switch (imin(kMR, rows - mb)) {
      case 6: f(Rows<6>{}, a, row0); break;
      case 5: f(Rows<5>{}, a, row0); break;
      case 4: f(Rows<4>{}, a, row0); break;
      case 3: f(Rows<3>{}, a, row0); break;
      case 2: f(Rows<2>{}, a, row0); break;
      default: f(Rows<1>{}, a, row0); break;
    }
  };
  // One row block (from row mb of the item) x one panel of B over one k block; pb: the panel's
  // partial sums (rows_p x NR).
  auto block = [&](int64_t mb, int64_t col0, int64_t nc, const S* b, int64_t ldb, int64_t k0, int64_t kc, S* pb,
                   const S* bias_p, PfRun pf) {
    const bool first = k0 == 0, last = k0 + kKC >= K;
    S* p = pb + mb * NR;
    rows_of(mb, k0, [&](auto r, const S* a, int64_t row0) {
      constexpr int R = decltype(r)::value;
      if (kmajor) rows_block<D, O, R, true>(t, row0, col0, nc, a, kMR, b, ldb, kc, first, last, p, bias_p, pf);
      else rows_block<D, O, R, false>(t, row0, col0, nc, a, lda, b, ldb, kc, first, last, p, bias_p, pf);
    });
  };

  if (t.b_sk == 1 && t.b_sn != 1) {
    // k-contiguous B ([G, N, K] weights, the forward): panels of NR columns (NR runs of K
    // elements), each packed one k block at a time into the same kKC x NR buffer (16 KiB, which
    // stays in L1) right before that block goes through every row block. While a panel computes,
    // the next one's rows of B (the next NR columns, past the item's and the task's end too:
    // usually what this thread packs next) are prefetched whole. Measured on the Intel AMX VM
    // with this level forced (fp32 forward, 2 threads, one process alternating, caches flushed,
    // 10-20 rounds, medians, 2026-12-03), whole panel -> per k block: G=64, M=2048, K=N=512
    // -2.3% / -3.3% (Dirichlet sizes), -3.8% (equal); G=256, M=4096, K=512, N=256 -0.8% / -1.7%;
    // G=32, M=4096, K=2048, N=512 -2.0%; fp16 +1.5% / -2.7%; G=8, M=2048, K=1024, N=2048 +1.1%.
    // Not measured on a CPU whose best level this is (Zen 2 and older: 32 KiB of L1d, which a
    // whole panel fills at K = 512).
    for (int64_t nb = 0; nb < cols; nb += NR) {
      const int64_t nc = imin(NR, cols - nb), col0 = it.n0 + nb;
      load_bias<D>(t, col0, nc, bias, NR);
      PrefetchBlock ahead(t.b, (col0 + NR) * t.b_sn * esz, NR, t.b_sn * esz, K * esz, k_blocks * row_blocks);
      for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += kKC) {  // K == 0: one pass, C = bias
        const int64_t kc = imin(kKC, K - k0);
        if (kc > 0) pack_b_kcontig<D>(t, k0, kc, col0, nc, bp);
        for (int64_t mb = 0; mb < rows; mb += kMR) block(mb, col0, nc, bp, NR, k0, kc, part, bias, ahead.take());
      }
    }
    return;
  }
  // Any other B (n-contiguous: [G, K, N] weights, the input gradient's, the weight gradient's dy):
  // slabs of kKC rows x `wide` columns, each row read once across the slab. With more than one k
  // block, the slab's panels go one by one through every row block (a panel stays in L1), with
  // partial sums for rows x wide between k blocks; there, full panels of fp32 / fp64 rows that
  // b_in_place allows are not packed but read where they lie. With one (K <= kKC: the weight
  // gradient, whose K is a group's tokens), the row blocks go one by one through the whole slab,
  // so that C is written row by row across the slab: runs of whole lines. Measured (as for the
  // prefetches) panel by panel -> row block by row block: bf16 weight gradient G=64 13.83 ->
  // 13.36 ms, G=256 19.72 -> 18.07 ms; fp32 level.
  const bool one_k = K <= kKC;
  const int64_t wide = one_k ? imin(kWideCols, round_up(cols, NR))
                             : imax(NR, imin(imin(kWideCols, round_up(cols, NR)), (kPartBytes / (int64_t)sizeof(S) / rows_p) / NR * NR));
  const bool rows_in_place = !one_k && b_in_place<D>(t);
  for (int64_t nw = 0; nw < cols; nw += wide) {
    const int64_t wc = imin(wide, cols - nw), panels = ceil_div(wc, NR);
    const bool in_place = rows_in_place && wc % NR == 0;
    load_bias<D>(t, it.n0 + nw, wc, bias, panels * NR);
    for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += kKC) {
      const int64_t kc = imin(kKC, K - k0);
      if (!in_place) pack_b_slab<D>(t, k0, kc, it.n0 + nw, wc, bp);
      // The next slab's rows while this one computes: the next kKC rows of these columns, or,
      // after the last, as many rows past K (the next group's, with [G, K, N] weights) when this
      // item ends its task, so that this thread's next item is usually that group's.
      const int64_t ke = k0 + kc, ahead_rows = ke < K ? imin(kKC, K - ke) : it.m1 == t.m && t.b_sn == 1 ? kc : 0;
      PrefetchBlock ahead(t.b, (ke * t.b_sk + (it.n0 + nw) * t.b_sn) * esz, ahead_rows, t.b_sk * esz,
                          t.b_sn == 1 ? wc * esz : 0, panels * row_blocks);
      if (one_k) {
        for (int64_t mb = 0; mb < rows; mb += kMR) {
          rows_of(mb, 0, [&](auto r, const S* a, int64_t row0) {
            constexpr int R = decltype(r)::value;
            if (kmajor) rows_strip<D, O, R, true>(t, row0, it.n0 + nw, wc, a, kMR, bp, kc, bias, ahead);
            else rows_strip<D, O, R, false>(t, row0, it.n0 + nw, wc, a, lda, bp, kc, bias, ahead);
          });
        }
      } else {
        for (int64_t p = 0; p < panels; ++p) {
          const int64_t col0 = it.n0 + nw + p * NR;
          const S* b = in_place ? (const S*)t.b + k0 * t.b_sk + col0 : bp + p * kc * NR;
          for (int64_t mb = 0; mb < rows; mb += kMR) {
            block(mb, col0, imin(NR, wc - p * NR), b, in_place ? t.b_sk : NR, k0, kc, part + p * rows_p * NR,
                  bias + p * NR, ahead.take());
          }
        }
      }
    }
  }
}

template <Dt D>
void item_out(Dt out, const Task& t, const Item& it, void* ws) {
  if (out == Dt::f32 && D != Dt::f32) item<D, Dt::f32>(t, it, ws);
  else item<D, D>(t, it, ws);
}

}  // namespace

int64_t max_item_rows(Dt in, const Task& task) { return item_rows(in, task.k); }

bool whole_row_items(Dt in, const Task& task) { return in != Dt::f64 && gemv_kind(task) == 2; }

int64_t workspace_bytes(Dt in, const Task& task) { return workspace(in, task.k); }

// Non-temporal stores (Task::stream) are weakly ordered: fenced before the thread leaves the
// parallel region, as the AVX-512 levels do, rather than left to the region's barrier.
void thread_end() { _mm_sfence(); }

void run_item(Dt in, Dt out, const Task& t, const Item& it, void* ws) {
  switch (in) {
    case Dt::f32: item<Dt::f32, Dt::f32>(t, it, ws); break;
    case Dt::bf16: item_out<Dt::bf16>(out, t, it, ws); break;
    case Dt::f16: item_out<Dt::f16>(out, t, it, ws); break;
    case Dt::f64: item<Dt::f64, Dt::f64>(t, it, ws); break;
  }
}

}  // namespace avx2
}  // namespace moe_cpu

#endif
