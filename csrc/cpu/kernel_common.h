// What the x86 kernel files (kernels_x86.cpp: AVX-512 and AMX; kernels_avx2.cpp: AVX2) share:
// the sanitizer build's check of the accesses ASan does not instrument, index arithmetic,
// scalar conversions, the element-type traits and the spreading of software prefetches over
// compute steps.
//
// Each kernel file includes this inside its own anonymous namespace, after <immintrin.h>,
// <stdint.h>, <string.h> and kernels.h, under its own `#pragma GCC target`: so each gets its own
// copy, compiled for its own instruction sets, and no inline function is shared between code
// for different CPUs (which the linker would be free to pick one copy of). Hence no include
// guard, no #include and no namespace here.

// Accesses AddressSanitizer does not see. GCC's ASan instruments plain loads and stores but not
// masked (AVX-512) or non-temporal (streaming) ones: measured, a masked load reaching 4 bytes
// past a malloc'd buffer and a _mm512_stream_ps or _mm256_stream_ps reaching 32 bytes past one
// went unreported, while a plain store there was caught. So in a sanitizer build
// (.ci/sanitizers.sh) each such access first checks its bytes here and reports like an
// instrumented one; otherwise this is nothing.
#if defined(__SANITIZE_ADDRESS__)
extern "C" void __asan_report_load_n(uintptr_t addr, size_t size);
extern "C" void __asan_report_store_n(uintptr_t addr, size_t size);
extern "C" void* __asan_region_is_poisoned(void* beg, size_t size);
inline void check_bytes(const void* p, size_t size, bool store) {
  if (char* bad = (char*)__asan_region_is_poisoned((void*)p, size)) {  // the first poisoned byte
    const size_t rest = (size_t)((const char*)p + size - bad);
    if (store) __asan_report_store_n((uintptr_t)bad, rest);
    else __asan_report_load_n((uintptr_t)bad, rest);
  }
}
#else
inline void check_bytes(const void*, size_t, bool) {}
#endif

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Conversions. bf16 rounding is round-to-nearest-even with NaN kept quiet, as c10::BFloat16 does;
// fp16 goes through F16C (round to nearest even, denormals kept).
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f32_to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

// Per dtype: the element type T, the accumulation type Acc, and one element read / written.
template <Dt D> struct Ty;
template <> struct Ty<Dt::f32> {
  using T = float;
  using Acc = float;
  static float get(const float* p) { return *p; }
  static void put(float* p, float v) { *p = v; }
};
template <> struct Ty<Dt::bf16> {
  using T = uint16_t;
  using Acc = float;
  static float get(const uint16_t* p) { return bf16_to_f32(*p); }
  static void put(uint16_t* p, float v) { *p = f32_to_bf16(v); }
};
template <> struct Ty<Dt::f16> {
  using T = uint16_t;
  using Acc = float;
  static float get(const uint16_t* p) { return f16_to_f32(*p); }
  static void put(uint16_t* p, float v) { *p = f32_to_f16(v); }
};
template <> struct Ty<Dt::f64> {
  using T = double;
  using Acc = double;
  static double get(const double* p) { return *p; }
  static void put(double* p, double v) { *p = v; }
};

// A run of cache lines for one compute step to prefetch.
struct PfRun {
  const char* first;  // first cache line
  int64_t lines;
  // All the run's lines into L2 at once (a prefetch never faults).
  void to_l2() const {
    for (int64_t l = 0; l < lines; ++l) _mm_prefetch(first + 64 * l, _MM_HINT_T1);
  }
};

// The lines of a block of memory that should arrive while a number of compute steps run (the
// operands an item packs next), handed out an equal share per step: `rows` runs of `run_bytes`,
// `stride` bytes apart, from p + offset. Prefetches never fault, so a guess past the end of an
// operand costs only the instruction.
struct PrefetchBlock {
  const char* base;
  int64_t rows, stride, lines_per_row, per_call, next = 0;
  PrefetchBlock(const void* p, int64_t offset, int64_t rows_, int64_t stride_, int64_t run_bytes, int64_t calls)
      : base((const char*)((uintptr_t)p + offset)), rows(rows_), stride(stride_), lines_per_row(ceil_div(run_bytes, 64)),
        per_call(ceil_div(rows_ * ceil_div(run_bytes, 64), imax(calls, 1))) {
    if (stride == lines_per_row * 64) {  // back-to-back runs (e.g. contiguous [G, N, K] weights): one run
      lines_per_row *= rows;
      rows = rows > 0 ? 1 : 0;
    }
  }
  // The next run of contiguous lines for one compute step.
  PfRun take() {
    if (next >= rows * lines_per_row) return {nullptr, 0};
    const int64_t row = next / lines_per_row, col = next % lines_per_row;
    const int64_t n = imin(per_call, lines_per_row - col);
    next += n;
    return {base + row * stride + col * 64, n};
  }
};
