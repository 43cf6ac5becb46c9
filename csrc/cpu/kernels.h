// Interface between the ATen glue (grouped_mm.cpp) and the x86 kernels (kernels_x86.cpp: AVX-512
// and AMX; kernels_avx2.cpp: AVX2).
//
// Only plain C types cross this boundary: kernels_x86.cpp is compiled with AVX-512/AMX code
// generation enabled and must not instantiate any template that another translation unit could
// also instantiate (the linker would be free to pick the AVX-512 copy for code that runs on any
// CPU). So it includes no ATen or standard C++ headers.
#pragma once

#include <stdint.h>

namespace moe_cpu {

enum class Dt : int32_t { f32 = 0, bf16 = 1, f16 = 2, f64 = 3 };

// Instruction sets the kernels can use, best last. Picked at run time from CPUID and the OS.
// avx2: AVX2 with FMA and F16C, no AVX-512 (AMD Zen 1-3, Intel Haswell and client chips).
// avx512bf16: AVX-512 with AVX512-BF16's dot product (VDPBF16PS), used for bf16 inputs (AMD Zen 4
// and later, Intel Cooper Lake; Sapphire Rapids and later have it too, beside AMX).
enum class Isa : int32_t { generic = 0, avx2 = 1, avx512 = 2, avx512bf16 = 3, amx = 4 };

constexpr int32_t kBf16Direct = 0, kBf16Swapped256 = 1, kBf16Swapped512 = 2;
// One matrix product C[m, n] = A[m, k] @ B[k, n] (+ bias[n]), strides in elements, any sign
// or value. A group of a grouped_mm call is one Task. C is written completely (k == 0 gives
// zeros, or the bias); the accumulation is in fp32 (fp64 for fp64) and C gets one rounding.
struct Task {
  const void* a;
  int64_t a_sm, a_sk;
  const void* b;
  int64_t b_sk, b_sn;
  void* c;
  int64_t c_sm, c_sn;
  const void* bias;  // nullptr or [n] in the input dtype
  int64_t bias_sn;
  int64_t m, n, k;
  bool stream;  // write C with non-temporal stores where whole aligned lines allow
  // bf16 on Isa::avx512bf16 with k-contiguous A and B: kBf16Direct (the columns of C in 512-bit
  // vector lanes), or C^T = W @ A^T with the rows of A in 256-bit (kBf16Swapped256) or 512-bit
  // (kBf16Swapped512) lanes (kernels_x86.cpp, "VB, swapped").
  int32_t bf16_scheme;
  // fma_item with n-contiguous B: prefetch a window of whole-row slabs ahead and touch the pages
  // past it (true: measured faster on AMD Zen 4), or only the next slab (kernels_x86.cpp).
  bool far_prefetch;
};

// The rows [m0, m1) and columns [n0, n1) of one task's C: the unit of work a thread takes.
struct Item {
  int64_t task;
  int64_t m0, m1, n0, n1;
};

namespace x86 {

// Largest number of rows of one Item of this task: for the FMA kernel, so that the packed rows
// of A stay in L2; AMX items take whole groups (see kernels_x86.cpp).
int64_t max_item_rows(Isa isa, Dt in, const Task& task);
// True for a task whose kernel streams the rows of B across all columns of an item (groups of a
// few rows with n-contiguous B): make_items then cuts it into as few column pieces as the
// threads need, so that each item reads whole rows of B.
bool whole_row_items(Isa isa, Dt in, const Task& task);
// Bytes of scratch one thread needs for items of this task.
int64_t workspace_bytes(Isa isa, Dt in, const Task& task);
// Called by each thread before / after its items (AMX: load / release the tile configuration).
void thread_begin(Isa isa, Dt in);
void thread_end(Isa isa, Dt in);
// Computes one item. workspace: 64-byte aligned, workspace_bytes(...) long, owned by the thread.
void run_item(Isa isa, Dt in, Dt out, const Task& task, const Item& item, void* workspace);

}  // namespace x86

// The AVX2 level (kernels_avx2.cpp): the same entry points for Isa::avx2, whose items need no
// per-thread set-up.
namespace avx2 {

int64_t max_item_rows(Dt in, const Task& task);
bool whole_row_items(Dt in, const Task& task);
int64_t workspace_bytes(Dt in, const Task& task);
void run_item(Dt in, Dt out, const Task& task, const Item& item, void* workspace);
void thread_end();

}  // namespace avx2
}  // namespace moe_cpu
