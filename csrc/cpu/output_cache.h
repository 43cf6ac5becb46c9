// Outputs of moe_cpu.grouped_mm from a per-process cache of mapped memory (output_cache.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace moe_cpu {

// A new uninitialized tensor. One of at least kCachedMinBytes comes from the cache: a block a
// freed output left behind, pages already mapped, when one of the same rounded size is there.
// *mapped says whether its pages are (most likely) mapped already: a block from the cache.
at::Tensor new_output(at::IntArrayRef shape, const at::TensorOptions& opts, bool* mapped);

// Bytes of free blocks the cache holds now, and its limit (MOE_OPS_CPU_CACHE_MB, read once).
int64_t cache_cached_bytes();
int64_t cache_limit_bytes();

// Returns every free block to the OS; the bytes it released.
int64_t cache_empty();

}  // namespace moe_cpu
