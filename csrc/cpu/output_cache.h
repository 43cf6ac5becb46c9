// Outputs of moe_cpu.grouped_mm from a per-process cache of mapped memory (output_cache.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace moe_cpu {

// A new uninitialized tensor (NaN under torch.use_deterministic_algorithms, as torch.empty). One
// of 8 MiB or more comes from the cache: a block a freed output left behind, pages already
// mapped, when one of the same size (rounded up to 2 MiB) is there.
at::Tensor new_output(at::IntArrayRef shape, const at::TensorOptions& opts);

// Whether t's memory is such a block, handed out again (pages mapped unless the OS reclaimed them).
bool in_reused_block(const at::Tensor& t);

// Bytes of free blocks the cache holds now, and its limit (MOE_OPS_CPU_CACHE_MB, read once).
int64_t cache_cached_bytes();
int64_t cache_limit_bytes();

// Returns every free block to the OS; the bytes it released.
int64_t cache_empty();

}  // namespace moe_cpu
