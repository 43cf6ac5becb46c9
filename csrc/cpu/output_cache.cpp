// A cache of output memory for moe_cpu.grouped_mm, in the spirit of PyTorch's CUDA caching
// allocator, for outputs of kCachedMinBytes and more.
//
// Why: glibc hands out allocations of 32 MiB and more as fresh mmaps and unmaps them on free,
// so every such output of the op was new pages, zeroed by the kernel on first touch. The weight
// gradient's output is G times the dense one's (64 MiB at G=256, K=512, N=256 in bf16), and
// there the page faults were most of the call. Measured here (2 threads, 2026-11-30): writing
// 64 MiB took 8-16 ms into fresh pages (huge pages or not, any store kind) against 1.5-4.6 ms
// into pages already mapped; torch.empty + fill_ of a [256, 512, 256] bf16 tensor 14.6 ms
// against 4.5 ms when glibc keeps the memory (MALLOC_MMAP_THRESHOLD_ raised).
//
// A freed output's block (its DataPtr's deleter runs on any thread) goes back to the cache, most
// recently freed last; one that has waited there for kIdleSeconds is marked MADV_FREE (the OS
// may then reclaim it under memory pressure) at the cache's next put or take. A new output takes
// the most recent free block of the same size (rounded up to 2 MiB), or maps a new one. Free
// blocks beyond the limit are unmapped, oldest first. The limit is MOE_OPS_CPU_CACHE_MB (read
// once; 0 turns the cache off), by default 1/16 of the machine's memory and at most 1 GiB. cache_empty() (Python: moe_ops.empty_cpu_cache()) unmaps every free
// block. Blocks are reported to torch.profiler, and the lock is held across fork().

#include "output_cache.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#endif

// In an AddressSanitizer build (.ci/sanitizers.sh) a block's bytes that no tensor owns are
// poisoned: the slack past an output's end (blocks are whole 2 MiB units, an output need not
// be), and the whole of a block while it waits in the cache. ASan's own red zones only guard
// the ends of the malloc'd block, so without this an overrun into the slack, or a write into a
// freed output's block, would go unreported.
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define MOE_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define MOE_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define MOE_POISON(p, n) ((void)(p), (void)(n))
#define MOE_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace moe_cpu {
namespace {

constexpr size_t kHuge = size_t(2) << 20;
constexpr size_t kCachedMinBytes = size_t(8) << 20;

// Asks for transparent huge pages before the first touch (when the system allows it, e.g. THP
// "madvise" mode; where it is refused nothing changes). Measured here: allocating and filling a
// [64, 512, 512] bf16 tensor took 14 ms in 4 KiB pages, ~4 ms in huge pages. For cache blocks
// they matter after the first touch too (2 threads, 3 processes each, medians of 10 calls):
// G=256, M=4096, K=512, N=256 bf16 weight gradient 4.9 ms against 10.3-10.7 ms in 4 KiB pages,
// a 256 MiB fp32 one 37.6-39.9 against 62.1-64.1 ms. Their first touch is slow on this VM (that
// 256 MiB output's first call 239-403 ms against 97-100 in 4 KiB pages; 117 MB filled: 165-194
// ms in the first 2-3 allocations of a process, then 11-23 ms), likely its host backing the
// guest's memory on first touch: a one-time cost per block.
void advise_huge(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t begin = (uintptr_t)p, end = begin + bytes;
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  if (bytes >= kCachedMinBytes && last > first) madvise((void*)first, last - first, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// A block of `bytes` (a multiple of kHuge), kHuge-aligned, mapped on its own; nullptr if none.
// Not posix_memalign: once glibc has unmapped one mmapped chunk it raises its mmap threshold to
// that size (up to 32 MiB), and later blocks of 8-32 MiB then came from its heap, where free()
// keeps them resident: empty_cpu_cache() and the limit released no memory to the OS (measured
// here: 11 blocks of 8-28 MiB freed, 198 MiB "released", RSS 203 MiB above where it was).
void* map_block(size_t bytes) {
#if defined(__linux__)
  // Over-map by one huge page and unmap the ends, so the block starts on a 2 MiB boundary.
  void* m = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                 0);
  if (m == MAP_FAILED) return nullptr;
  const uintptr_t begin = (uintptr_t)m, p = (begin + kHuge - 1) & ~(kHuge - 1);
  if (p > begin) munmap(m, p - begin);
  if (begin + kHuge > p) munmap((void*)(p + bytes), begin + kHuge - p);
  return (void*)p;
#else
  void* p = nullptr;
  return posix_memalign(&p, kHuge, bytes) == 0 ? p : nullptr;
#endif
}

void unmap_block(void* p, size_t bytes) {
#if defined(__linux__)
  munmap(p, bytes);
#else
  (void)bytes;
  std::free(p);
#endif
}

int64_t default_limit() {
  const char* env = std::getenv("MOE_OPS_CPU_CACHE_MB");
  // Clamped to 2^40 MiB before the shift: atoll saturates "99999999999999999999" at 2^63 - 1,
  // and shifting that left is undefined.
  if (env != nullptr && *env != '\0') return std::clamp<int64_t>(std::atoll(env), 0, int64_t(1) << 40) << 20;
  int64_t mem = int64_t(16) << 30;
#if defined(__linux__)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) mem = (int64_t)pages * page;
#endif
  return std::min<int64_t>(mem / 16, int64_t(1) << 30);
}

// MADV_FREE only for blocks left in the cache this long. Marking every freed block at once
// cost a steady loop ~15% of a weight gradient: G=64, M=2048, K=N=512 fp32 (64 MiB output,
// 2 threads, 3 alternating processes) took 5.78-6.28 ms with it and 5.13-5.18 ms without; perf
// put ~5% of the samples in the TLB shootdown it sends the other core (smp_call_function_many_cond,
// and native_write_msr: the IPI's exit to the hypervisor). A loop that reuses its outputs
// within a second never pays it; a block left longer pays it once.
constexpr std::chrono::seconds kIdleSeconds{1};

struct Block {
  void* p;
  size_t bytes;
  bool reused;  // taken from the cache (pages mapped unless the OS took them back)
  bool advised = false;  // marked MADV_FREE since it was last handed out
  std::chrono::steady_clock::time_point freed{};
};

class OutputCache final : public c10::Allocator {
 public:
  const int64_t limit = default_limit();

  c10::DataPtr allocate(size_t n) override {
    if (n < kCachedMinBytes || limit == 0) {
      c10::DataPtr d = c10::GetCPUAllocator()->allocate(n);
      advise_huge(d.get(), n);
      return d;
    }
    const size_t bytes = (n + kHuge - 1) / kHuge * kHuge;
    Block* b = take(bytes);
    if (b == nullptr) {
      void* p = map_block(bytes);
      TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr,
                       "moe_cpu.grouped_mm: cannot allocate ", bytes, " bytes for the output");
      advise_huge(p, bytes);
      b = new Block{p, bytes, false};
    }
    MOE_UNPOISON(b->p, n);
    MOE_POISON(static_cast<char*>(b->p) + n, bytes - n);
    hand_out(b);
    return {b->p, b, &OutputCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Whether d holds a block this cache handed out again.
  static bool reused(const c10::DataPtr& d) {
    return d.get_deleter() == &OutputCache::release && static_cast<const Block*>(d.get_context())->reused;
  }

  int64_t cached() {
    std::lock_guard<std::mutex> g(mu_);
    return cached_;
  }

  // fork() from another thread while this one holds the lock would leave the child's copy
  // locked for ever (a DataLoader worker freeing its first large output would hang): hold it
  // across the fork, as glibc does for malloc, so both sides start with it free and consistent.
  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }

  int64_t empty() {
    std::vector<Block*> out;
    {
      std::lock_guard<std::mutex> g(mu_);
      out.swap(free_);
      cached_ = 0;
    }
    return drop(out);
  }

 private:
  std::mutex mu_;
  std::vector<Block*> free_;  // oldest first
  int64_t cached_ = 0;  // bytes of the free blocks
  int64_t used_ = 0;    // bytes of the blocks handed out and not yet given back

  // The block handed out is taken before the others are looked at: marking it first would only
  // cost the madvise and, once it is written again, the faults.
  Block* take(size_t bytes) {
    std::lock_guard<std::mutex> g(mu_);
    Block* b = nullptr;
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if ((*it)->bytes == bytes) {
        b = *it;
        free_.erase(std::next(it).base());
        cached_ -= (int64_t)bytes;
        b->reused = true;
        b->advised = false;
        break;
      }
    }
    advise_idle();
    return b;
  }

  // Marks the free blocks idle for kIdleSeconds MADV_FREE: the kernel may take their pages back
  // under memory pressure (a later write then faults in zeroed pages, which is fine: an output
  // is written completely); until then they stay mapped, huge pages included. Called with mu_
  // held, so that no block is handed out (and written) while it is being marked.
  void advise_idle() {
#if defined(__linux__) && defined(MADV_FREE)
    const auto now = std::chrono::steady_clock::now();
    for (Block* b : free_) {
      if (!b->advised && now - b->freed >= kIdleSeconds) {
        madvise(b->p, b->bytes, MADV_FREE);
        b->advised = true;
      }
    }
#endif
  }

  static void release(void* ctx);

  // Tells torch.profiler (profile_memory=True) about a block handed out (bytes > 0) or given
  // back, as c10's CPU allocator does for its own allocations: "allocated" counts the blocks in
  // use, "reserved" those and the free ones, both as they stand after the change (a block given
  // back stays reserved while the cache keeps it). It takes the block's address and size, not
  // the block: once put() has unlocked, another thread's take(), empty() or eviction may hand
  // the block out again or delete it.
  static void report(void* p, int64_t bytes, int64_t used, int64_t reserved) {
    if (c10::memoryProfilingEnabled()) {
      c10::reportMemoryUsageToProfiler(p, bytes, (size_t)used, (size_t)reserved, c10::Device(c10::DeviceType::CPU));
    }
  }

  void hand_out(const Block* b) {
    int64_t used, reserved;
    {
      std::lock_guard<std::mutex> g(mu_);
      used_ += (int64_t)b->bytes;
      used = used_;
      reserved = used_ + cached_;
    }
    report(b->p, (int64_t)b->bytes, used, reserved);
  }

  void put(Block* b) {
    void* const p = b->p;
    const int64_t bytes = (int64_t)b->bytes;
    MOE_POISON(p, bytes);
    b->freed = std::chrono::steady_clock::now();
    std::vector<Block*> out;
    int64_t used, reserved;
    {
      std::lock_guard<std::mutex> g(mu_);
      advise_idle();
      used_ -= bytes;
      free_.push_back(b);
      cached_ += bytes;
      size_t i = 0;
      while (cached_ > limit && i < free_.size()) {
        cached_ -= (int64_t)free_[i]->bytes;
        out.push_back(free_[i++]);
      }
      free_.erase(free_.begin(), free_.begin() + (int64_t)i);
      used = used_;
      reserved = used_ + cached_;
    }
    report(p, -bytes, used, reserved);
    drop(out);
  }

  static int64_t drop(const std::vector<Block*>& blocks) {
    int64_t n = 0;
    for (Block* b : blocks) {
      n += (int64_t)b->bytes;
      MOE_UNPOISON(b->p, b->bytes);
      unmap_block(b->p, b->bytes);
      delete b;
    }
    return n;
  }
};

// Never destroyed: outputs may be freed during interpreter shutdown, after static destructors.
OutputCache& cache() {
  static OutputCache* c = [] {
    auto* made = new OutputCache();
#if defined(__linux__)
    pthread_atfork([] { cache().lock(); }, [] { cache().unlock(); }, [] { cache().unlock(); });
#endif
    return made;
  }();
  return *c;
}

void OutputCache::release(void* ctx) { cache().put(static_cast<Block*>(ctx)); }

}  // namespace

at::Tensor new_output(at::IntArrayRef shape, const at::TensorOptions& opts) {
  at::Tensor out = at::detail::empty_generic(shape, &cache(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                             c10::typeMetaToScalarType(opts.dtype()), c10::nullopt);
  // As torch.empty does under torch.use_deterministic_algorithms(True) (with
  // torch.utils.deterministic.fill_uninitialized_memory, on by default there): NaN, so that an
  // element the kernels fail to write shows as one instead of as what an earlier output of the
  // same size left in the memory (glibc and the cache hand that memory back; tests/test_cpu.py
  // runs the kernels so).
  const auto& ctx = at::globalContext();
  if (ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory()) {
    out.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  return out;
}

bool in_reused_block(const at::Tensor& t) { return OutputCache::reused(t.storage().data_ptr()); }

int64_t cache_cached_bytes() { return cache().cached(); }
int64_t cache_limit_bytes() { return cache().limit; }
int64_t cache_empty() { return cache().empty(); }

}  // namespace moe_cpu
