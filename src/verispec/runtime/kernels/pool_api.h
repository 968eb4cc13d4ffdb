// The work pool's interface, shared by pool.cpp (which owns the one pool of a process) and parallel.h (which every
// kernel includes): plain C types and function pointers, so that the kernels, each its own extension, all use the
// one pool through the table whose address pool.cpp hands out (ext.py passes it to each kernel as it loads).
#pragma once
#include <cstdint>

namespace verispec_pool {

// One chunk of a parallel region: items [begin, end) of the caller's loop.
using ChunkFn = void (*)(void* ctx, int64_t begin, int64_t end);

struct PoolApi {
  // Runs fn over items [0, n) in chunks of at least `grain` items (the last one shorter; the pool cuts a region into
  // a few chunks per thread), on the calling thread and the pool's running workers, and returns when every chunk
  // has run (on the calling thread alone where n <= grain, one thread runs, or the region is nested). Chunks are handed out one at a time to whichever
  // thread asks first: a worker the OS has descheduled holds back at most the chunk it is running, and one that
  // wakes after the last chunk was taken takes nothing (the caller never waits for a thread, only for chunks).
  // The first exception a chunk throws is rethrown here once every other chunk has run.
  void (*run)(void* ctx, ChunkFn fn, int64_t n, int64_t grain);
  // Threads a region runs on now (the caller included): set_threads' value.
  int (*threads)();
};

}  // namespace verispec_pool
