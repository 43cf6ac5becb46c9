// An emulator of the AMX operations kernels_x86.cpp uses, for a test build only (setup.py with
// MOE_OPS_AMX_EMULATOR=1; .ci/sanitizers.sh builds so on CPUs with AVX512-BF16 and no AMX): the
// AMX kernels, which are otherwise compiled but never run on such a CPU, then run with their
// tiles in memory, every other instruction native, and under AddressSanitizer every tile load
// and store is an instrumented memcpy. The machine reports Isa::amx wherever the CPU has
// AVX512-BF16 (the AMX kernels' packing and epilogues use it), also on CPUs with AMX.
//
// Semantics from the Intel SDM's pseudo-code (LDTILECFG, TILELOADD, TILESTORED, TILEZERO,
// TDPBF16PS, TILERELEASE), palette 1: 8 tiles of up to 16 rows x 64 bytes. TDPBF16PS keeps, per
// row m and column n, two fp32 sums over the k pairs, one of the even and one of the odd bf16
// (each step a fused multiply-add, inputs denormal treated as zero, denormal results flushed to
// zero, round to nearest even), adds the two, and adds that to C[m][n]. Not compared with
// hardware bit for bit; the tests compare the kernels' results with their tolerance.
//
// Included by kernels_x86.cpp inside its anonymous namespace, after <immintrin.h> and <string.h>,
// where its AVX-512 code generation is on.

namespace amx_emu {

struct State {
  bool configured = false;  // by LDTILECFG with a nonzero palette; tile instructions fault before
  uint16_t colsb[8] = {};
  uint8_t rows[8] = {};
  alignas(64) unsigned char tile[8][16][64] = {};
};

// Each thread's tiles, as each core's are (thread_begin configures them per thread).
inline State& state() {
  static thread_local State s;
  return s;
}

// The tiles as a tile instruction finds them: one before LDTILECFG (or after TILERELEASE)
// faults, as on the hardware (#UD, SIGILL), where it would otherwise work on empty tiles here.
inline State& configured() {
  State& s = state();
  if (!s.configured) __builtin_trap();
  return s;
}

// LDTILECFG: palette 1's layout (the palette at byte 0, 16 colsb entries at byte 16, 16 rows
// entries at byte 48); the tiles are zeroed.
inline void config(const void* cfg) {
  const unsigned char* c = (const unsigned char*)cfg;
  State& s = state();
  s.configured = c[0] != 0;
  for (int t = 0; t < 8; ++t) {
    memcpy(&s.colsb[t], c + 16 + 2 * t, 2);
    s.rows[t] = c[48 + t];
  }
  memset(s.tile, 0, sizeof(s.tile));
}

inline void release() { state() = State(); }

inline void zero(int t) { memset(configured().tile[t], 0, sizeof(State::tile[0])); }

// TILELOADD: the configured rows and bytes of each, `stride` bytes apart; the rest is zero.
inline void load(int t, const void* base, int64_t stride) {
  State& s = configured();
  zero(t);
  for (int r = 0; r < s.rows[t]; ++r) memcpy(s.tile[t][r], (const char*)base + r * stride, s.colsb[t]);
}

// TILESTORED: the configured rows and bytes.
inline void store(int t, void* base, int64_t stride) {
  const State& s = configured();
  for (int r = 0; r < s.rows[t]; ++r) memcpy((char*)base + r * stride, s.tile[t][r], s.colsb[t]);
}

// Lanes holding denormals as zeros of their sign (DAZ on an input, FTZ on a result).
inline __m512 daz(__m512 v) { return _mm512_mask_and_ps(v, _mm512_fpclass_ps_mask(v, 0x20), v, _mm512_set1_ps(-0.0f)); }

// TDPBF16PS c, a, b: C (rows x colsb/4 fp32) += A (rows x colsb/4 bf16 pairs) . B (k pairs x
// columns, VNNI: row k holds pair k of every column), a row of C at a time in a vector (its
// columns in the lanes). 512-bit instructions, not scalar code: the sanitizer build runs at -O1
// and instruments every access, and with a scalar loop that stage's tests took 624 s instead of
// 264 s on the Zen 4 VM (2026-12-07).
inline void dpbf16ps(int c, int a, int b) {
  State& s = configured();
  const int pairs = s.colsb[a] / 4;
  const __mmask16 cols = (__mmask16)((1u << (s.colsb[c] / 4)) - 1);
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int m = 0; m < s.rows[c]; ++m) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (int k = 0; k < pairs; ++k) {
      const __m512i bk = _mm512_loadu_si512(s.tile[b][k]);  // pair k of each column: bf16 [2n], [2n + 1]
      uint32_t ak;
      memcpy(&ak, s.tile[a][m] + 4 * k, 4);  // pair k of row m
      const __m512i av = _mm512_set1_epi32((int)ak);
      even = daz(_mm512_fmadd_ps(daz(_mm512_castsi512_ps(_mm512_slli_epi32(av, 16))),
                                 daz(_mm512_castsi512_ps(_mm512_slli_epi32(bk, 16))), even));
      odd = daz(_mm512_fmadd_ps(daz(_mm512_castsi512_ps(_mm512_and_si512(av, high))),
                                daz(_mm512_castsi512_ps(_mm512_and_si512(bk, high))), odd));
    }
    const __m512 sum = daz(_mm512_add_ps(daz(_mm512_loadu_ps((const float*)s.tile[c][m])), daz(_mm512_add_ps(even, odd))));
    _mm512_storeu_ps((float*)s.tile[c][m], _mm512_maskz_mov_ps(cols, sum));  // columns past colsb zero
  }
}

}  // namespace amx_emu
