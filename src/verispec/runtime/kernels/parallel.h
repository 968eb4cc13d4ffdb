// Parallel regions of the kernels: `parallel_for(begin, end, grain, f)` with at::parallel_for's contract (f(b, e)
// over disjoint ranges covering [begin, end), each of at least `grain` items but the last; f must not depend on
// which thread runs it), run on the process's work pool (pool.cpp, pool_api.h): small chunks handed out to whichever
// thread is running, so a thread the OS has descheduled on a busy machine stalls a step by at most one chunk, not
// half of every region. Which thread computes an output never changes its bits: every kernel computes each output
// on its own, in a fixed order. Before ext.py hands a kernel the pool (`use_pool`), and for a nested region, the
// region runs as at::parallel_for (OpenMP) / on the calling thread.
#pragma once
#include <ATen/Parallel.h>
#include <cstdint>
#include "pool_api.h"

namespace verispec_pool {

// The pool's table, set once by `use_pool` as the extension loads (one per extension: each is its own library).
inline const PoolApi* g_pool = nullptr;

// For PYBIND11_MODULE: `m.def("use_pool", &verispec_pool::use_pool)`; ext.py passes pool.cpp's table address.
inline void use_pool(int64_t address) { g_pool = reinterpret_cast<const PoolApi*>(address); }

template <typename F>
void run_chunk(void* ctx, int64_t begin, int64_t end) {
  (*static_cast<const F*>(ctx))(begin, end);
}

// Threads a region runs on now.
inline int64_t threads() { return g_pool ? g_pool->threads() : at::get_num_threads(); }

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  if (g_pool == nullptr) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const auto shifted = [&](int64_t b, int64_t e) { f(begin + b, begin + e); };
  g_pool->run(const_cast<void*>(static_cast<const void*>(&shifted)), &run_chunk<decltype(shifted)>, n, grain);
}

}  // namespace verispec_pool
