// moe_ops' native CPU kernel for moe::grouped_mm: torch.ops.moe_cpu.grouped_mm.
//
// moe_ops/backends/cpu.py registers it as the op's CPU kernel through kernel_entry, which has
// already checked the call against the contract (moe_ops/_contract.py) and the offs values. The
// TORCH_CHECKs here are not a second contract: they only guard memory safety (every pointer this
// file forms stays inside its tensor whatever the caller passes).
//
// Every group is one Task (C = A @ B + bias on strided views). Groups with at least 2^26
// multiply-adds in fp32 (not on AMD CPUs above the generic level), or 2^28 in bf16 at the generic
// and AVX-512 levels (and out_dtype == input dtype, no bias), go to ATen's mm with all threads,
// one after the other (see whole_group_mm and is_big). The others are
// cut into Items (row chunks of at most a few hundred rows for the FMA kernel, whole groups for
// AMX) with enough column chunks that every thread gets work, and the threads of one
// at::parallel_for region take items from a shared counter until none are left. So many small groups keep all cores busy with one trip through the thread pool per
// call (a loop of torch.mm makes one per group, each split across the threads). Each item runs
// an x86 kernel (AMX for bf16, AVX-512 FMA otherwise; kernels_x86.cpp) or, on other CPUs,
// ATen's mm on the item's views, single-threaded inside the region.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <Python.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "../common/torch_version_guard.h"
#include "kernels.h"
#include "output_cache.h"

namespace moe_cpu {
namespace {

using at::Tensor;

// ---------------------------------------------------------------------------------------------
// CPU features

#if defined(__x86_64__) || defined(_M_X64)
uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}

Isa detect_isa_x86() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Isa::generic;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave || !fma || !f16c) return Isa::generic;
  // The OS saves the SSE and AVX state (the AVX2 level needs no more).
  if ((xgetbv0() & 0x6) != 0x6) return Isa::generic;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return Isa::generic;
  const bool avx2 = b & (1u << 5);
  if (!avx2) return Isa::generic;
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));  // F DQ BW VL
  // AVX-512 also needs the OS to save the opmask registers and both halves of the ZMM registers.
  if (!avx512 || (xgetbv0() & 0xE6) != 0xE6) return Isa::avx2;
  const bool amx = (d & (1u << 24)) && (d & (1u << 22));  // AMX-TILE, AMX-BF16
  unsigned a1 = 0, b1, c1, d1;
  const bool bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 & (1u << 5));  // AVX512-BF16
  const Isa without_amx = bf16 ? Isa::avx512bf16 : Isa::avx512;
#if defined(MOE_OPS_AMX_EMULATOR)
  // A test build: the AMX kernels with their tiles on our emulator (amx_emulator.h), wherever
  // the rest of them can run.
  return bf16 ? Isa::amx : without_amx;
#endif
  if (!amx) return without_amx;
  // Linux hands out the AMX tile state only on request (once per process; oneDNN asks too).
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return without_amx;
  if ((xgetbv0() & (3ull << 17)) != (3ull << 17)) return without_amx;
  return Isa::amx;
}
#endif

// The x86 family of an AMD CPU (0x19: Zen 3 / Zen 4, 0x1A: Zen 5), 0 for any other CPU.
unsigned amd_family() {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
  const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "AuthenticAMD"
  if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
  return ((a >> 8) & 0xF) + (((a >> 8) & 0xF) == 0xF ? (a >> 20) & 0xFF : 0);
#else
  return 0;
#endif
}

// amd_family(), asked once.
unsigned amd_cpu_family() {
  static const unsigned family = amd_family();
  return family;
}

// AMD Zen 4 (family 0x19 with AVX-512) executes a 512-bit operation as two 256-bit halves, so
// 256-bit VDPBF16PS runs at twice the rate of the 512-bit one: the same multiply-adds per cycle
// (measured on a Zen 4 VM: 3.62 G zmm / 7.24 G ymm instructions per second, 231 GFLOP/s both).
// bf16 there takes the kernels' swapped scheme with rows of A in 256-bit lanes (Task::bf16_scheme).
// Cores with full-width 512-bit units (Zen 5; Intel Cooper Lake, the one Intel CPU with
// AVX512-BF16 and no AMX) take it with rows of A in 512-bit lanes (see default_bf16_scheme).
bool half_width_cpu() { return amd_cpu_family() == 0x19; }

// The bf16 scheme for k-contiguous operands on AVX512-BF16 without AMX (Task::bf16_scheme): the
// swapped one in 256-bit lanes where 512-bit operations run as two halves, else in 512-bit lanes.
// Measured on a 2-core AMD EPYC Zen 5 VM (family 0x1A, 2026-12-01; forward with [G, N, K] weights
// in 4 KiB pages, 2 threads, the three schemes and a dense torch.mm alternating call by call in one
// process, 48 MiB written between calls, group sizes drawn anew per call, 10 rounds, medians,
// ratio to dense; benchmarks/schemes.py), direct / 256-bit swapped / 512-bit swapped: G=8,
// M=4096, K=1024, N=2048 x1.01 / x1.71 / x0.95; G=64, M=2048, K=N=512 x1.87 / x2.15 / x1.42; G=256,
// M=4096, K=512, N=256 x2.63 / x2.27 / x1.72; Mixtral /4 x1.28 / x2.01 / x1.11; GPT-OSS-20B /4
// x2.09 / x2.12 / x1.26; OLMoE /2 x1.42 / x2.01 / x1.21; Qwen3-30B-A3B /4 x1.99 / x2.15 / x1.44;
// DeepSeek-V3 /16 x2.78 / x2.29 / x1.69. With one weight matrix shared by all groups (the compute
// alone, 1 thread) 512-bit swapped / direct 0.71-0.95. Cooper Lake: not measured (none here).
int32_t default_bf16_scheme() { return half_width_cpu() ? kBf16Swapped256 : kBf16Swapped512; }

// fma_item's far prefetches for n-contiguous B (Task::far_prefetch, the input gradient's and
// weight gradient's layout): tuned on the Zen 4 VM (2026-12-01, figures at the window and at
// warm_pages in kernels_x86.cpp), slower on the Intel AMX-class VM (family 6 model 167), where
// prefetching only the next slab wins. Measured there (2026-12-03, 2 threads, both alternating
// call by call in one process, 64 MiB written between calls, 16-20 rounds, medians), far -> next
// slab only: input gradient fp32 G=64, M=2048, K=N=512 5.63 -> 5.15 ms (Dirichlet sizes), 5.36 ->
// 4.60 ms (equal groups); G=256, M=4096, K=512, N=256 8.75 -> 7.49 ms, 8.74 -> 7.65 ms; fp16 G=64
// 5.26 -> 4.85 ms, G=256 7.07 -> 6.54 ms; fp64 G=64 14.78 -> 14.84 ms, G=256 21.46 -> 18.69 ms;
// G=128, M=32768, K=512, N=192 25.59 -> 24.08 ms; G=256, M=32768, K=448, N=128 16.74 -> 15.56 ms;
// G=8 / 32 / 64 with larger experts level (+-0.5%); weight gradients level (+-1%). Without the
// page warming alone or the window alone: between the two. Other vendors' CPUs: not measured
// (none here), so they take the plain prefetch too.
bool default_far_prefetch() { return amd_cpu_family() != 0; }

Isa detect_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  return detect_isa_x86();
#else
  return Isa::generic;
#endif
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::amx: return "amx";
    case Isa::avx512bf16: return "avx512_bf16";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

// The best instruction set of this machine, capped by MOE_OPS_CPU_ISA=generic|avx2|avx512|avx512_bf16|amx.
Isa machine_isa() {
  static const Isa isa = [] {
    Isa best = detect_isa();
    const char* env = std::getenv("MOE_OPS_CPU_ISA");
    if (env != nullptr) {
      for (Isa cap : {Isa::generic, Isa::avx2, Isa::avx512, Isa::avx512bf16, Isa::amx}) {
        if (std::strcmp(env, isa_name(cap)) == 0 && (int)cap < (int)best) best = cap;
      }
    }
    return best;
  }();
  return isa;
}

Dt to_dt(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return Dt::f32;
    case at::kBFloat16: return Dt::bf16;
    case at::kHalf: return Dt::f16;
    case at::kDouble: return Dt::f64;
    default: TORCH_CHECK(false, "moe_cpu.grouped_mm: unsupported dtype ", t);
  }
}

// ---------------------------------------------------------------------------------------------
// Problem -> tasks

struct Problem {
  std::vector<Task> tasks;
  Tensor out;
};

// Group ends; must be a partition of [0, extent] (kernel_entry checked it; re-checked here
// because every pointer below depends on it).
std::vector<int64_t> read_offs(const Tensor& offs, int64_t G, int64_t extent) {
  TORCH_CHECK(offs.dim() == 1 && offs.size(0) == G, "moe_cpu.grouped_mm: offs must be [", G, "]");
  TORCH_CHECK(offs.scalar_type() == at::kInt || offs.scalar_type() == at::kLong, "moe_cpu.grouped_mm: offs dtype");
  TORCH_CHECK(offs.device().is_cpu(), "moe_cpu.grouped_mm: offs must be a CPU tensor");
  // Read in place (any stride): converting int32 offs to int64 first cost ~2 us a call, a third
  // of a tiny call's time in this file.
  std::vector<int64_t> ends(G);
  auto read = [&](const auto* o) {
    for (const auto g : c10::irange(G)) ends[g] = o[g * offs.stride(0)];
  };
  if (offs.scalar_type() == at::kInt) read(offs.data_ptr<int32_t>());
  else read(offs.data_ptr<int64_t>());
  int64_t prev = 0;
  for (int64_t e : ends) {
    TORCH_CHECK(prev <= e && e <= extent, "moe_cpu.grouped_mm: offs is not a partition of [0, ", extent, "]");
    prev = e;
  }
  return ends;
}

// An operand with no elements is never read (an item with rows and columns then has k == 0),
// but its strides can be anything (as_strided allows any on an empty storage), and the group
// offsets and item offsets formed from them (g * stride, m0 * stride) overflowed int64: the same
// operand with zero strides instead.
Tensor strides_zero_if_empty(const Tensor& t) {
  return t.numel() == 0 ? t.as_strided(t.sizes(), std::vector<int64_t>(t.dim(), 0), 0) : t;
}

// Largest K (the contraction's length, per group in 2Dx2D) the kernels take: their workspace
// sizes grow with K (~256 bytes per k) and wrapped int64 from K ~ 2^55, which only stride-0
// (expanded) operands reach; up to this bound those sizes stay far below 2^63 (a request that
// large fails cleanly with bad_alloc).
constexpr int64_t kMaxK = int64_t(1) << 40;

const char* ptr(const Tensor& t, int64_t offset_elems) {
  return static_cast<const char*>(t.data_ptr()) + offset_elems * (int64_t)t.element_size();
}

Task make_task(const Tensor& a, int64_t a_off, int64_t a_sm, int64_t a_sk, const Tensor& b, int64_t b_off,
               int64_t b_sk, int64_t b_sn, const Tensor& c, int64_t c_off, int64_t c_sm, int64_t c_sn,
               const Tensor* bias, int64_t g, int64_t m, int64_t n, int64_t k) {
  Task t{};
  t.a = ptr(a, a_off);
  t.a_sm = a_sm;
  t.a_sk = a_sk;
  t.b = ptr(b, b_off);
  t.b_sk = b_sk;
  t.b_sn = b_sn;
  t.c = const_cast<char*>(ptr(c, c_off));
  t.c_sm = c_sm;
  t.c_sn = c_sn;
  t.bias = bias != nullptr ? ptr(*bias, g * bias->stride(0)) : nullptr;
  t.bias_sn = bias != nullptr ? bias->stride(1) : 0;
  t.m = m;
  t.n = n;
  t.k = k;
  return t;
}

Problem build(const std::string& layout, const Tensor& mat_a, const Tensor& mat_b,
              const c10::optional<Tensor>& offs, const c10::optional<Tensor>& bias_in,
              at::ScalarType out_dtype) {
  const Tensor a = strides_zero_if_empty(mat_a), b = strides_zero_if_empty(mat_b);
  c10::optional<Tensor> bias_opt = bias_in;
  if (bias_opt.has_value() && bias_opt->defined()) bias_opt = strides_zero_if_empty(*bias_opt);
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "moe_cpu.grouped_mm: CPU tensors only");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "moe_cpu.grouped_mm: mat_a and mat_b dtypes differ");
  (void)to_dt(a.scalar_type());  // raises for an unsupported dtype
  TORCH_CHECK(out_dtype == a.scalar_type() || (out_dtype == at::kFloat && (a.scalar_type() == at::kBFloat16 ||
                                                                           a.scalar_type() == at::kHalf)),
              "moe_cpu.grouped_mm: out_dtype");
  const Tensor* bias = bias_opt.has_value() && bias_opt->defined() ? &*bias_opt : nullptr;
  // Before any task reads the bias's strides.
  auto check_bias = [&](int64_t G, int64_t N) {
    TORCH_CHECK(bias == nullptr || (bias->device().is_cpu() && bias->dim() == 2 && bias->size(0) == G &&
                                    bias->size(1) == N && bias->scalar_type() == a.scalar_type()),
                "moe_cpu.grouped_mm: bias must be [G, N] on the CPU in the inputs' dtype");
  };
  // K is mat_a's last dimension in every layout (a rank-0 mat_a fails its layout's check below).
  TORCH_CHECK(a.dim() == 0 || a.size(-1) <= kMaxK, "moe_cpu.grouped_mm: K = ", a.size(-1),
              " is past 2^40");
  const auto opts = a.options().dtype(out_dtype);
  Problem p;
  if (layout == "2d3d") {
    TORCH_CHECK(a.dim() == 2 && b.dim() == 3 && a.size(1) == b.size(1), "moe_cpu.grouped_mm: 2d3d shapes");
    const int64_t M = a.size(0), K = a.size(1), G = b.size(0), N = b.size(2);
    check_bias(G, N);
    TORCH_CHECK(offs.has_value(), "moe_cpu.grouped_mm: offs missing");
    const auto ends = read_offs(*offs, G, M);
    p.out = new_output({M, N}, opts);
    int64_t s = 0;
    for (const auto g : c10::irange(G)) {
      p.tasks.push_back(make_task(a, s * a.stride(0), a.stride(0), a.stride(1), b, g * b.stride(0), b.stride(1),
                                  b.stride(2), p.out, s * N, N, 1, bias, g, ends[g] - s, N, K));
      s = ends[g];
    }
    if (s < M) p.out.narrow(0, s, M - s).zero_();  // rows past offs[-1]
  } else if (layout == "2d2d") {
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "moe_cpu.grouped_mm: 2d2d shapes");
    TORCH_CHECK(bias == nullptr, "moe_cpu.grouped_mm: no bias for 2d2d");
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
    TORCH_CHECK(offs.has_value(), "moe_cpu.grouped_mm: offs missing");
    const int64_t G = offs->size(0);
    const auto ends = read_offs(*offs, G, K);
    p.out = new_output({G, M, N}, opts);
    int64_t s = 0;
    for (const auto g : c10::irange(G)) {
      // An empty group is a task with k == 0: its slice is written with zeros.
      p.tasks.push_back(make_task(a, s * a.stride(1), a.stride(0), a.stride(1), b, s * b.stride(0), b.stride(0),
                                  b.stride(1), p.out, g * M * N, N, 1, nullptr, g, M, N, ends[g] - s));
      s = ends[g];
    }
  } else if (layout == "3d3d") {
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1),
                "moe_cpu.grouped_mm: 3d3d shapes");
    const int64_t G = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
    check_bias(G, N);
    p.out = new_output({G, M, N}, opts);
    // An output without elements takes no tasks: its G is bounded by nothing (stride-0 operands
    // of 2^40 groups and M = 0 made a Task per group until memory ran out).
    for (const auto g : c10::irange(p.out.numel() == 0 ? 0 : G)) {
      p.tasks.push_back(make_task(a, g * a.stride(0), a.stride(1), a.stride(2), b, g * b.stride(0), b.stride(1),
                                  b.stride(2), p.out, g * M * N, N, 1, bias, g, M, N, K));
    }
  } else if (layout == "3d2d") {
    TORCH_CHECK(a.dim() == 3 && b.dim() == 2 && a.size(2) == b.size(0), "moe_cpu.grouped_mm: 3d2d shapes");
    TORCH_CHECK(bias == nullptr, "moe_cpu.grouped_mm: no bias for 3d2d");
    const int64_t G = a.size(0), M = a.size(1), K = a.size(2), N = b.size(1);
    TORCH_CHECK(offs.has_value(), "moe_cpu.grouped_mm: offs missing");
    const auto ends = read_offs(*offs, G, N);
    p.out = new_output({M, N}, opts);
    int64_t s = 0;
    for (const auto g : c10::irange(G)) {
      p.tasks.push_back(make_task(a, g * a.stride(0), a.stride(1), a.stride(2), b, s * b.stride(1), b.stride(0),
                                  b.stride(1), p.out, s, N, 1, nullptr, g, M, ends[g] - s, K));
      s = ends[g];
    }
    if (s < N) p.out.narrow(1, s, N - s).zero_();  // columns past offs[-1]
  } else {
    TORCH_CHECK(false, "moe_cpu.grouped_mm: unknown layout ", layout);
  }
  return p;
}

// ---------------------------------------------------------------------------------------------
// Tasks -> items, and the parallel region

// Cuts every task into items: row chunks of at most `max_rows(k)`, and column chunks (multiples
// of `n_align`) small enough that the largest item is at most 1/8 of one thread's share. With
// dynamic scheduling that bounds the idle tail to about an eighth of a share, and items stay big
// enough (>= 64 columns) for the packed block of B to pay off. A task too narrow for that many
// column chunks is cut into more (and equal) row chunks instead. A task for which
// `whole_rows(task)` holds is cut only to one thread's share (its kernel reads rows of B across
// the item's columns: the wider the item, the longer the runs it reads).
template <typename MaxRows, typename WholeRows>
std::vector<Item> make_items(const std::vector<Task>& tasks, int64_t threads, int64_t n_align, const MaxRows& max_rows,
                             const WholeRows& whole_rows) {
  double total = 0;
  for (const auto& t : tasks) total += (double)t.m * t.n * (double)std::max<int64_t>(t.k, 16);
  const double fine_cap = std::max(total / (8.0 * threads), 1.0), share = std::max(total / threads, 1.0);
  std::vector<Item> items;
  for (const auto i : c10::irange((int64_t)tasks.size())) {
    const Task& t = tasks[i];
    if (t.m == 0 || t.n == 0) continue;
    const double cap = whole_rows(t) ? share : fine_cap;
    const int64_t max_cols_pieces = std::max<int64_t>(1, t.n / std::max<int64_t>(64, n_align));
    const double task_cost = (double)t.m * t.n * (double)std::max<int64_t>(t.k, 16);
    const int64_t need = std::max<int64_t>(1, (int64_t)std::ceil(task_cost / cap));
    const int64_t row_pieces = (need + max_cols_pieces - 1) / max_cols_pieces;
    int64_t rows = max_rows(t);
    if (row_pieces > (t.m + rows - 1) / rows) rows = (t.m + row_pieces - 1) / row_pieces;
    for (int64_t m0 = 0; m0 < t.m; m0 += rows) {
      const int64_t m1 = std::min(t.m, m0 + rows);
      const double cost = (double)(m1 - m0) * t.n * (double)std::max<int64_t>(t.k, 16);
      int64_t pieces = std::max<int64_t>(1, (int64_t)std::ceil(cost / cap));
      pieces = std::min(pieces, max_cols_pieces);
      const int64_t width = (t.n + pieces - 1) / pieces;
      const int64_t step = (width + n_align - 1) / n_align * n_align;
      for (int64_t n0 = 0; n0 < t.n; n0 += step) items.push_back({i, m0, m1, n0, std::min(t.n, n0 + step)});
    }
  }
  return items;
}

// Runs body(item index, thread state) over all items on the threads of one parallel region.
// Each thread owns a contiguous run of items of about equal cost and takes them in order, so it
// reads the weights of consecutive groups as one stream (the kernels prefetch across the end of
// a group); a thread that is done takes the remaining items of the others, so one descheduled
// thread (the machine here is shared) does not hold up the call.
template <typename Begin, typename Body, typename End>
void run_items(const std::vector<double>& cost, const Begin& begin, const Body& body, const End& end) {
  const int64_t n = (int64_t)cost.size();
  if (n == 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  struct alignas(64) Run {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  std::unique_ptr<Run[]> runs(new Run[threads]);
  double total = 0;
  for (double c : cost) total += c;
  double acc = 0;
  for (int64_t i = 0, t = 0; t < threads; ++t) {
    runs[t].next.store(i, std::memory_order_relaxed);
    while (i < n && (t == threads - 1 || acc + cost[i] / 2 <= total * (t + 1) / threads)) acc += cost[i++];
    runs[t].end = i;
  }
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t tid = b; tid < e; ++tid) {
      auto state = begin();
      for (int64_t k = 0; k < threads; ++k) {
        Run& r = runs[(tid + k) % threads];
        for (int64_t i; (i = r.next.fetch_add(1, std::memory_order_relaxed)) < r.end;) body(i, state);
      }
      end(state);
    }
  });
}

std::vector<double> item_costs(const std::vector<Task>& tasks, const std::vector<Item>& items) {
  std::vector<double> cost;
  cost.reserve(items.size());
  for (const Item& it : items) {
    cost.push_back((double)(it.m1 - it.m0) * (double)(it.n1 - it.n0) * (double)std::max<int64_t>(tasks[it.task].k, 16));
  }
  return cost;
}

// Per-thread scratch of at least `bytes`, 64-byte aligned, reused across calls (packed operands:
// at most ~1 MiB for K <= 1024). Not zero-filled: the kernels write before they read. A weight
// gradient over K tokens asks for ~256 bytes per token (K = 2^20: 256 MiB a thread), which
// release_large_scratch hands back at the end of the call instead of keeping it for the
// thread's life.
struct Scratch {
  std::unique_ptr<char[]> data;
  int64_t size = 0;
};
thread_local Scratch tl_scratch;
constexpr int64_t kScratchKeepBytes = int64_t(16) << 20;

void* thread_scratch(int64_t bytes) {
  if (tl_scratch.size < bytes + 64) {
    tl_scratch.data.reset();  // the old block first: never both at once
    tl_scratch.size = 0;      // if the new one throws (bad_alloc), no later call takes nullptr
    tl_scratch.data.reset(new char[bytes + 64]);
    tl_scratch.size = bytes + 64;
  }
  return reinterpret_cast<void*>(((uintptr_t)tl_scratch.data.get() + 63) & ~(uintptr_t)63);
}

void release_large_scratch() {
  if (tl_scratch.size > kScratchKeepBytes) {
    tl_scratch.data.reset();
    tl_scratch.size = 0;
  }
}

void run_x86(Isa isa, Dt in, Dt out, const std::vector<Task>& tasks) {
  const int64_t threads = at::get_num_threads();
  const int64_t n_align = (isa == Isa::amx && in == Dt::bf16) ? 32 : 64;
  const auto items = make_items(
      tasks, threads, n_align, [&](const Task& t) { return x86::max_item_rows(isa, in, t); },
      [&](const Task& t) { return x86::whole_row_items(isa, in, t); });
  int64_t ws_bytes = 0;
  for (const auto& t : tasks) ws_bytes = std::max(ws_bytes, x86::workspace_bytes(isa, in, t));
  run_items(
      item_costs(tasks, items),
      [&] {
        x86::thread_begin(isa, in);
        return thread_scratch(ws_bytes);
      },
      [&](int64_t i, void* ws) { x86::run_item(isa, in, out, tasks[items[i].task], items[i], ws); },
      [&](void*) {
        x86::thread_end(isa, in);
        release_large_scratch();
      });
}

void run_avx2(Dt in, Dt out, const std::vector<Task>& tasks) {
  const auto items = make_items(
      tasks, at::get_num_threads(), 64, [&](const Task& t) { return avx2::max_item_rows(in, t); },
      [&](const Task& t) { return avx2::whole_row_items(in, t); });
  int64_t ws_bytes = 0;
  for (const auto& t : tasks) ws_bytes = std::max(ws_bytes, avx2::workspace_bytes(in, t));
  run_items(
      item_costs(tasks, items), [&] { return thread_scratch(ws_bytes); },
      [&](int64_t i, void* ws) { avx2::run_item(in, out, tasks[items[i].task], items[i], ws); },
      [](void*) {
        avx2::thread_end();
        release_large_scratch();
      });
}

// c = a @ b through ATen's mm, with the operands as that mm must see them to be right.
// * In bf16, A is a contiguous copy where its rows are further apart than its K. oneDNN's bf16
//   gemm with AMX (torch 2.13) reads each row of A past K when the rows are further apart
//   (measured on an Intel AMX VM, 2026-12-04: K = 3, 7, 33, 34, 257 read up to the next
//   multiple of 8; K = 2, 6, 66, 130 did not), and a NaN or inf there (the next group's K
//   indices in a weight gradient, the tokens past offs[-1]) makes the product NaN through the
//   zeros it pads B with; a finite value there changes no bit (oneDNN's issue #5717, its AMX
//   brgemm's K tail; a fix was merged as #5723 in 2026-08, not in torch 2.13's oneDNN). The copy
//   is m * k elements against m * k * n multiply-adds.
// * In bf16 and fp16, no vector with a stride other than 1 along it: one row of A (or of C), or
//   one column of B (or of C). torch 2.9.1's CPU mm (its oneDNN path; with
//   torch.backends.mkldnn off it is right) returns wrong values there, errors of 30-150 on
//   products of magnitude ~20 (measured on an Intel AMX VM, 2026-12-05, k = 301 and 1024; a
//   row of A 37 elements apart is the weight gradient's one-row item of a transposed mat_a;
//   in bf16 on the AMD Zen 4 VM too, k = 37-1024). torch 2.13.0 and 2.14.1 are right on the
//   same cases. Built against torch 2.9.1 without these copies, the generic level failed three
//   tests of tests/test_cpu.py (the page-guard test and two 2Dx2D large-output ones); with
//   them, none. The copies are k (A, B) or n (C) elements against k * n multiply-adds.
// ATen's mm serves the generic level and large groups at the AVX-512 level: on a CPU whose best
// level that is, oneDNN has no AMX, but the tests run both levels on AMX machines too.
void mm_into(Tensor& c, const Tensor& a, const Tensor& b) {
  const bool half = a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf;
  const bool rows_apart = a.scalar_type() == at::kBFloat16 && a.size(0) > 1 && a.stride(1) == 1 &&
                          a.stride(0) > a.size(1);
  const bool a_vec = half && a.size(0) == 1 && a.stride(1) != 1;
  const bool b_vec = half && b.size(1) == 1 && b.stride(0) != 1;
  const bool c_vec = half && ((c.size(0) == 1 && c.stride(1) != 1) || (c.size(1) == 1 && c.stride(0) != 1));
  const Tensor a_mm = rows_apart || a_vec ? a.contiguous() : a;
  const Tensor b_mm = b_vec ? b.contiguous() : b;
  if (c_vec) {
    c.copy_(at::mm(a_mm, b_mm));
  } else {
    at::mm_out(c, a_mm, b_mm);
  }
}

// The portable path: ATen's mm (MKL / oneDNN / ATen's blas) on each item's views, single-threaded
// inside the parallel region.
void run_generic(at::ScalarType in, at::ScalarType out, const std::vector<Task>& tasks) {
  const auto items = make_items(
      tasks, at::get_num_threads(), 16, [](const Task&) { return int64_t{256}; }, [](const Task&) { return false; });
  const auto acc = in == at::kDouble ? at::kDouble : at::kFloat;
  const auto in_opts = at::TensorOptions().dtype(in);
  run_items(
      item_costs(tasks, items), [] { return 0; },
      [&](int64_t i, int) {
        const Item& it = items[i];
        const Task& t = tasks[it.task];
        const int64_t rows = it.m1 - it.m0, cols = it.n1 - it.n0, esz = c10::elementSize(in);
        const int64_t osz = c10::elementSize(out);
        auto a = at::from_blob(const_cast<char*>((const char*)t.a) + it.m0 * t.a_sm * esz, {rows, t.k},
                               {t.a_sm, t.a_sk}, in_opts);
        auto b = at::from_blob(const_cast<char*>((const char*)t.b) + it.n0 * t.b_sn * esz, {t.k, cols},
                               {t.b_sk, t.b_sn}, in_opts);
        auto c = at::from_blob((char*)t.c + (it.m0 * t.c_sm + it.n0 * t.c_sn) * osz, {rows, cols}, {t.c_sm, t.c_sn},
                               at::TensorOptions().dtype(out));
        if (t.bias == nullptr && out == in) {
          mm_into(c, a, b);  // ATen's CPU mm accumulates bf16/fp16 in fp32 and rounds once
          return;
        }
        auto r = at::mm(a.to(acc), b.to(acc));
        if (t.bias != nullptr) {
          r.add_(at::from_blob(const_cast<char*>((const char*)t.bias) + it.n0 * t.bias_sn * esz, {cols},
                               {t.bias_sn}, in_opts)
                     .to(acc));
        }
        c.copy_(r);
      },
      [](int) {});
}

// Groups with at least this many multiply-adds go to ATen's mm with all threads, one after the
// other; the rest share one parallel region of items. Only for out_dtype == input dtype and no
// bias (ATen has no bf16 x bf16 -> fp32 mm, and the bias must be added before the one rounding).
// * fp32, from 2^26 multiply-adds (m >= 64 rows at K = 1024, N = 1024), to MKL, except on AMD
//   CPUs (amd_cpu_family) at the AVX2 and AVX-512 levels. Measured on an Intel AMX-class VM (2026-11-29;
//   2 threads, 15 interleaved rounds, medians, time / dense mm), 2^28 -> 2^26: OLMoE /2 (G=64,
//   M=4096, K=1024, N=512) fwd x2.24 -> x2.10 (torch._grouped_mm x2.15); Mixtral /4 (G=8,
//   M=1024, K=1024, N=3584) fwd x1.52 -> x1.46 (x1.55); G=64, M=2048, K=N=512 x2.39 -> x2.30
//   (x3.08). All groups through MKL: x2.03, x1.46, x3.11. On a Zen 4 VM (2026-12-01; 2 threads,
//   caches flushed between calls, group sizes drawn per call, medians of 8) the FMA items have
//   since caught up (single group, warm: 178-206 GFLOP/s against MKL's 148-195 at m = 64-2048),
//   and every group on the items beat this path: G=8, M=4096, K=1024, N=2048 fwd 96.9 -> 90.9 ms,
//   dgrad 100.0 -> 93.6, wgrad 92.9 -> 88.9 (dense 89.5-103); Mixtral /4 (M=2048) fwd 49.0 ->
//   41.1, dgrad 48.3 -> 41.3, wgrad 43.7 -> 37.4; OLMoE /2 fwd 26.6 -> 24.9, dgrad 24.9 -> 22.4;
//   GPT-OSS /4 fwd 15.1 -> 13.3; smaller experts level. On a Zen 5 VM (family 0x1A, 2026-12-01,
//   same method, 10 rounds), where MKL reaches 150-160 GFLOP/s and the items 340 (MKL takes
//   its AVX-512 code on Intel CPUs only), MKL -> items: G=8 fwd / dgrad / wgrad 96.6 / 100.9 /
//   98.6 -> 50.0 / 49.8 / 47.3 ms (dense 95-111); Mixtral /4 63.6 / 60.8 / 54.8 -> 27.3 / 24.0 /
//   22.3; GPT-OSS-20B /4 13.3 / 12.3 / 10.4 -> 10.3 / 8.4 / 7.4; OLMoE /2 23.6 / 24.0 / 20.8 ->
//   18.4 / 15.6 / 13.4. Re-measured on the Intel AMX VM (2026-12-02, same method, 10 rounds,
//   ratio to dense), MKL / items: G=8 fwd x0.96 / x0.99, dgrad x0.94 / x0.98, wgrad x1.07 /
//   x1.15; G=64 and G=256 within 1-4% either way; so Intel CPUs keep this path. At the generic
//   level (ATen's mm per item; MKL capped to AVX2 on the same VM) the two were within 3-7% either
//   way, so that level keeps this path. At the AVX2 level on a Zen 2 VM (family 23, 2026-12-02;
//   2 threads, caches flushed, group sizes drawn per call, 8 rounds, ratio to dense), MKL /
//   items: G=8, M=4096, K=1024, N=2048 fwd x0.97 / x0.81, dgrad x0.95 / x0.94, wgrad x1.07 /
//   x1.12; so AMD CPUs keep the items there too. Intel CPUs without AVX-512: not measured (none
//   here); they keep MKL, whose home they are.
// * bf16, from 2^28, to oneDNN, but only at the generic and AVX-512 levels. At the AVX2 level
//   oneDNN has no bf16 kernel worth the name: on a Zen 2 VM (2026-12-02, 2 threads) the G=8,
//   M=4096, K=1024, N=2048 input gradient took 58 s that way (0.3 GFLOP/s), and the AVX2 items
//   convert bf16 to fp32 as they pack (kernels_avx2.cpp). With AMX every
//   group runs on our items (amx_item_panels for large ones): oneDNN generates code for every new
//   group size (its primitive cache is keyed by the shape), and in a MoE layer the sizes change
//   on every call.
//   Measured here (2 threads, G=8, M=4096, K=1024, N=2048, Dirichlet group sizes drawn anew for
//   every call, medians of 20-25): oneDNN forward 38.8 ms, input gradient 64.1 ms, weight
//   gradient 53.6 ms; the AMX items 13.6-14.5 / 13.6-14.6 / 21.7 ms; dense mm 9-15 ms. With the
//   same sizes on every call (oneDNN's cache hits) the two are within 10% on the forward and
//   input gradient, and the items take 23 ms against 30 ms on the weight gradient.
//   With AVX512-BF16 (VDPBF16PS) the items win too. Measured on a 2-core AMD EPYC (Zen 4) VM
//   (2026-11-30, `benchmarks/bench.py --shapes issue --dtypes bf16`, 2 threads, fresh sizes,
//   ratio to dense, runs alternating): same shape, groups of >= 2^28 to oneDNN / all on the
//   items: forward x1.18 / x1.01 and x1.03, input gradient x1.25 / x1.12 and x1.06.
// * fp32 with k-contiguous B (the forward's [G, N, K] weights) at the AVX-512 levels: to MKL
//   only from kMklMinRowsKContig rows, past which MKL's transposed-B gemm outruns the FMA items.
//   Measured on the Intel AMX VM (2026-12-04, 2 threads, one group of m rows x 8 groups, K=1024,
//   N=2048, GFLOP/s, MKL / items): m = 32 201 / 309, 64 272 / 364, 128 328 / 346, 256 356 / 369,
//   512 403 / 382, 1024 420 / 390; with n-contiguous B (input gradient) 64 300 / 338, 128
//   350 / 347, 256 361 / 374, 512 412 / 383; the weight gradient's tasks (k = the group's rows)
//   MKL 380-421 / items 327-407 at k = 32-2048, so both of those keep 2^26. In process,
//   alternating, Dirichlet sizes drawn per round, 64 MiB written between calls, 20 rounds,
//   medians, forward, threshold 0 -> 384 rows: Mixtral /4 (G=8, M=1024, K=1024, N=3584) 25.6 ->
//   22.0 and 25.9 -> 22.2 ms; G=8, M=4096, K=1024, N=2048 44.2 -> 43.0, 44.1 -> 43.4, 44.7 ->
//   43.3 ms; OLMoE /2 (G=64, M=4096, K=1024, N=512) 16.1 -> 15.2, 15.3 -> 15.0 ms; GPT-OSS /4,
//   G=64 and G=256 level. The input gradient with the same rule: G=8 level, Mixtral /4 23.7 ->
//   25.6 ms, so it keeps 2^26.
constexpr double kBigTaskMacs = double(1 << 28);
constexpr double kBigTaskMacsF32 = double(1 << 26);
constexpr int64_t kMklMinRowsKContig = 384;

bool is_big(const Task& t, at::ScalarType dtype, Isa isa) {
  if (dtype == at::kFloat && isa >= Isa::avx512 && t.b_sk == 1 && t.m < kMklMinRowsKContig) return false;
  const double macs = (double)t.m * (double)t.n * (double)t.k;
  return macs >= (dtype == at::kFloat ? kBigTaskMacsF32 : kBigTaskMacs);
}

void run_big(at::ScalarType dtype, const Task& t) {
  const auto opts = at::TensorOptions().dtype(dtype);
  auto a = at::from_blob(const_cast<void*>(t.a), {t.m, t.k}, {t.a_sm, t.a_sk}, opts);
  auto b = at::from_blob(const_cast<void*>(t.b), {t.k, t.n}, {t.b_sk, t.b_sn}, opts);
  auto c = at::from_blob(t.c, {t.m, t.n}, {t.c_sm, t.c_sn}, opts);
  mm_into(c, a, b);
}

// An output of this size or more whose pages are mapped already (a block from the output cache)
// is written with non-temporal stores: no read for ownership of lines that are then overwritten,
// and the output does not evict the operands from the caches. Measured here (2 threads,
// 2026-11-30, 20 rounds alternating in one process, medians, output from the cache): weight
// gradient G=256, M=4096, K=512, N=256 bf16 10.5-10.9 -> 5.9-6.6 ms, fp32 13.0 -> 7.9 ms;
// G=64, M=2048, K=N=512 bf16 5.1 -> 3.3 ms (with the row order of amx_item_panels), fp32
// 10.8 -> 5.8 ms. Into fresh pages they are slower (G=256 bf16 20.9 -> 30.4 ms: the kernel
// zeroes each page into the cache first, and the non-temporal store then has to evict that
// line), so a fresh output is written as before. From 8 MiB (every block of the cache): G=8,
// M=4096, K=1024, N=2048 bf16 (16 MiB forward output, 8 MiB input gradient) with the next
// operation reading the output (a sum) and 64 MiB written between calls, threshold 8 against
// 32 MiB alternating call by call in one process: forward 14.2 / 15.0, 18.0 / 19.0, 15.7 /
// 17.4 ms, input gradient 17.9 / 18.7, 14.9 / 15.7, 19.5 / 19.5 ms (2026-11-30, medians of
// 20-30; L2 is 2 MiB per core here, so an output this large is not in it for the next
// operation either way).
constexpr size_t kStreamBytes = size_t(8) << 20;

// The level a call runs at: the machine's best, or isa_cap where that is lower (-1: no cap).
Isa capped_isa(int64_t isa_cap) {
  const Isa isa = machine_isa();
  return isa_cap >= 0 && isa_cap < (int64_t)isa ? (Isa)isa_cap : isa;
}

// For each task, whether it goes to ATen's mm with all threads (run_big) rather than to the
// items (see kBigTaskMacs for the rules and the figures behind them).
std::vector<bool> whole_group_mm(const std::vector<Task>& tasks, at::ScalarType dtype, at::ScalarType out_dtype,
                                 Isa isa) {
  const bool ok = out_dtype == dtype && ((dtype == at::kFloat && (isa == Isa::generic || amd_cpu_family() == 0)) ||
                                         (dtype == at::kBFloat16 && (isa == Isa::generic || isa == Isa::avx512)));
  std::vector<bool> big(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) big[i] = ok && tasks[i].bias == nullptr && is_big(tasks[i], dtype, isa);
  return big;
}

Tensor grouped_mm(c10::string_view layout, const Tensor& mat_a, const Tensor& mat_b, const c10::optional<Tensor>& offs,
                  const c10::optional<Tensor>& bias, at::ScalarType out_dtype, int64_t isa_cap, int64_t bf16_scheme,
                  int64_t far_prefetch) {
  Problem p = build(std::string(layout), mat_a, mat_b, offs, bias, out_dtype);
  const Isa isa = capped_isa(isa_cap);
  const auto dtype = mat_a.scalar_type();
  const bool stream = p.out.nbytes() >= kStreamBytes && in_reused_block(p.out);
  // Checked before the narrowing to int32 (2^32 + 1 used to pass as 1), as far_prefetch is.
  TORCH_CHECK(bf16_scheme >= -1 && bf16_scheme <= kBf16Swapped512,
              "moe_cpu.grouped_mm: bf16_scheme");
  const int32_t scheme = bf16_scheme < 0 ? default_bf16_scheme() : (int32_t)bf16_scheme;
  TORCH_CHECK(far_prefetch >= -1 && far_prefetch <= 1, "moe_cpu.grouped_mm: far_prefetch");
  const bool far = far_prefetch < 0 ? default_far_prefetch() : far_prefetch == 1;
  for (Task& t : p.tasks) {
    t.stream = stream;
    t.bf16_scheme = scheme;
    t.far_prefetch = far;
  }
  std::vector<Task> small;
  const auto big = whole_group_mm(p.tasks, dtype, out_dtype, isa);
  for (size_t i = 0; i < p.tasks.size(); ++i) {
    if (big[i]) run_big(dtype, p.tasks[i]);
    else small.push_back(p.tasks[i]);
  }
  if (isa == Isa::generic) {
    run_generic(dtype, out_dtype, small);
  } else {
#if defined(__x86_64__) || defined(_M_X64)
    if (isa == Isa::avx2) run_avx2(to_dt(dtype), to_dt(out_dtype), small);
    else run_x86(isa, to_dt(dtype), to_dt(out_dtype), small);
#endif
  }
  return p.out;
}

// Which kernel a call with this dtype runs here: "amx", "avx512_bf16", "avx512" or "generic".
std::string kernel_for(at::ScalarType dtype, int64_t isa_cap) {
  Isa isa = capped_isa(isa_cap);
  if (isa >= Isa::avx512bf16 && dtype != at::kBFloat16) isa = Isa::avx512;
  return isa_name(isa);
}

std::string machine() { return isa_name(machine_isa()); }

// The groups (tasks, in order: a 3D operand's batch entries) that grouped_mm with the same
// arguments sends to ATen's mm whole; the tests use it to pin which path their shapes exercise.
// It builds the problem as the call does (its offs checks, its output allocated), nothing more.
std::vector<int64_t> mm_groups(c10::string_view layout, const Tensor& mat_a, const Tensor& mat_b,
                               const c10::optional<Tensor>& offs, const c10::optional<Tensor>& bias,
                               at::ScalarType out_dtype, int64_t isa_cap) {
  const Problem p = build(std::string(layout), mat_a, mat_b, offs, bias, out_dtype);
  const auto big = whole_group_mm(p.tasks, mat_a.scalar_type(), out_dtype, capped_isa(isa_cap));
  std::vector<int64_t> groups;
  for (size_t i = 0; i < big.size(); ++i) {
    if (big[i]) groups.push_back((int64_t)i);
  }
  return groups;
}

std::vector<int64_t> cache_info() { return {cache_cached_bytes(), cache_limit_bytes()}; }

// The ops, registered by PyInit__cpu once the torch version is checked (not by static
// TORCH_LIBRARY initialisers, which would run at dlopen, before any check). Never deleted: the
// dispatcher may be gone by the time static destructors run.
void register_ops() {
  auto* def = new torch::Library(torch::Library::DEF, "moe_cpu", std::nullopt, __FILE__, __LINE__);
  // isa: -1 = best for this machine, 0 = generic (ATen mm per item), 1 = AVX2, 2 = AVX-512,
  // 3 = AVX-512 with AVX512-BF16, 4 = AMX; a value above what the machine has means the best it has.
  // bf16_scheme (bf16 on AVX512-BF16 without AMX, k-contiguous operands): -1 = this CPU's
  // choice (default_bf16_scheme), 0 = direct, 1 = swapped in 256-bit lanes, 2 = swapped in 512-bit
  // lanes. far_prefetch (fma_item with n-contiguous B): -1 = this CPU's choice
  // (default_far_prefetch), 0 = the next slab only, 1 = the window and the pages past it.
  def->def("grouped_mm(str layout, Tensor mat_a, Tensor mat_b, Tensor? offs, Tensor? bias, ScalarType out_dtype, "
           "int isa=-1, int bf16_scheme=-1, int far_prefetch=-1) -> Tensor");
  def->def("kernel_for(ScalarType dtype, int isa=-1) -> str", &kernel_for);
  def->def("machine() -> str", &machine);
  // Whether this is the test build whose AMX level runs on the emulator (amx_emulator.h).
  def->def("amx_emulated() -> bool", [] {
#if defined(MOE_OPS_AMX_EMULATOR)
    return true;
#else
    return false;
#endif
  });
  def->def("mm_groups(str layout, Tensor mat_a, Tensor mat_b, Tensor? offs, Tensor? bias, ScalarType out_dtype, "
           "int isa=-1) -> int[]",
           &mm_groups);
  // The bf16 scheme for k-contiguous operands here (the bf16_scheme that -1 means).
  def->def("bf16_scheme() -> int", [] { return (int64_t)default_bf16_scheme(); });
  // Whether fma_item prefetches far ahead here (the far_prefetch that -1 means).
  def->def("far_prefetch() -> bool", [] { return default_far_prefetch(); });
  // The output cache (output_cache.cpp): [bytes of free blocks held, limit]; empty_cache unmaps
  // the free blocks and returns how many bytes that released.
  def->def("cache_info() -> int[]", &cache_info);
  def->def("empty_cache() -> int", &cache_empty);
  // The allocation grouped_mm writes its output into, unwritten: tests check that it is NaN under
  // deterministic algorithms, the guard that makes an element a kernel misses fail the tests.
  def->def("new_output(int[] size, ScalarType dtype) -> Tensor",
           [](at::IntArrayRef size, at::ScalarType dtype) { return new_output(size, at::TensorOptions().dtype(dtype)); });
  auto* cpu = new torch::Library(torch::Library::IMPL, "moe_cpu", c10::DispatchKey::CPU, __FILE__, __LINE__);
  cpu->impl("grouped_mm", &grouped_mm);
}

}  // namespace
}  // namespace moe_cpu

// `import moe_ops._cpu` checks the torch version and registers the ops above (no pybind11; the
// module itself is empty).
extern "C" PyObject* PyInit__cpu(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_cpu", "moe_ops' native CPU kernels (torch.ops.moe_cpu)",
                                   -1, nullptr};
  if (!moe_ops_guard::same_torch("moe_ops._cpu")) return nullptr;
  try {
    moe_cpu::register_ops();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ImportError, e.what());
    return nullptr;
  }
  return PyModule_Create(&def);
}
