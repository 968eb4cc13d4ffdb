// The kernels' work pool (runtime/kernels/pool.py builds it; parallel.h is how a kernel uses it): one per process,
// the calling thread plus `threads - 1` workers, shared by every kernel extension through the table of pool_api.h.
//
// Why not OpenMP's team (at::parallel_for): a region there splits its items statically between the threads and
// ends at a barrier every thread must reach, so on a machine doing other things each of a step's ~270 regions
// waits for whichever thread the OS has descheduled (the region takes a time slice, milliseconds, instead of tens
// of microseconds). Here a region is a ticket: chunks are taken one at a time by whoever asks first (one atomic
// add), the caller takes chunks too, and the caller waits only until every chunk has *run*, never for a thread to
// arrive: a worker that wakes late finds the chunks gone and takes none.
//
// Waiting: a worker with nothing to do spins for `spin_us` (a step's regions follow one another within
// microseconds, and a futex wake costs 5-50 us), then sleeps on a futex until the next region; the caller waiting
// for a chunk another thread runs does the same (its sleep leaves the core to that thread, should the OS have put
// it on the same core). Workers beyond `threads - 1` sleep until set_threads asks for them. pool.py measured the
// spin (idle and beside a busy process; docs/runner.md, "Threads").
//
// The ticket: one 64-bit word, the region's epoch in the high 32 bits and the next chunk's index in the low 32,
// counted up from LIMIT - chunks so that a claim is valid iff its index is below LIMIT: a thread can tell whether
// it got a chunk without reading the region (which the caller may already be rewriting for the next one); a valid
// claim means the region is not finished, so its fields are stable until the claimed chunk reports done.
#include <torch/extension.h>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "pool_api.h"

namespace {

using verispec_pool::ChunkFn;
using verispec_pool::PoolApi;

constexpr uint64_t LIMIT = uint64_t(1) << 31;  // a claim is valid iff its index is below this (see the header)
constexpr int MAX_THREADS = 256;
constexpr int64_t SPIN_US = 50;           // how long an idle thread spins before it sleeps (measured: docs/runner.md)
constexpr int64_t CHUNKS_PER_THREAD = 2;  // chunks a region is cut into per thread, at least

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
inline void futex_wake(std::atomic<uint32_t>* word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}
inline void pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Spins while pred() holds, for at most `us` microseconds -> whether pred() stopped holding.
template <typename Pred>
bool spin_while(const Pred& pred, int64_t us) {
  if (us <= 0) return !pred();
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (int i = 0;; ++i) {
    if (!pred()) return true;
    pause();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return !pred();
  }
}

thread_local bool t_inside = false;  // this thread is running a chunk

// A positive integer from the environment, else `fallback`.
int64_t env_int(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr) return fallback;
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  return end != text && v >= 0 ? v : fallback;
}

class Pool {
 public:
  Pool() {
    spin_us_.store(env_int("VERISPEC_POOL_SPIN_US", SPIN_US));
    chunks_per_thread_.store(std::max<int64_t>(1, env_int("VERISPEC_POOL_CHUNKS", CHUNKS_PER_THREAD)));
    set_threads(std::max(1, at::get_num_threads()));
  }

  ~Pool() {
    stopping_.store(true);
    epoch_word_.fetch_add(1);
    futex_wake(&epoch_word_, INT_MAX);
    threads_word_.fetch_add(1);
    futex_wake(&threads_word_, INT_MAX);
    for (auto& t : workers_) t.join();
  }

  int threads() const { return threads_.load(std::memory_order_relaxed); }

  void set_threads(int n) {
    TORCH_CHECK(n >= 1 && n <= MAX_THREADS, "threads must be 1..", MAX_THREADS, ", got ", n);
    std::lock_guard<std::mutex> lock(run_mutex_);  // never between a region's start and its end
    while (static_cast<int>(workers_.size()) < n - 1) {
      const int index = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, index] { work(index); });
    }
    threads_.store(n);
    threads_word_.fetch_add(1);
    futex_wake(&threads_word_, INT_MAX);
  }

  void set_spin_us(int64_t us) { spin_us_.store(us); }
  void set_chunks_per_thread(int64_t c) {
    TORCH_CHECK(c >= 1, "chunks per thread must be at least 1");
    chunks_per_thread_.store(c);
  }
  int64_t spin_us() const { return spin_us_.load(); }

  void run(void* ctx, ChunkFn fn, int64_t n, int64_t grain) {
    const int64_t nthreads = threads(), per_thread = chunks_per_thread_.load(std::memory_order_relaxed);
    const int64_t chunk = std::max({grain, int64_t(1), (n + nthreads * per_thread - 1) / (nthreads * per_thread)});
    const int64_t chunks = (n + chunk - 1) / chunk;
    if (t_inside || chunks <= 1 || nthreads <= 1 || chunks >= static_cast<int64_t>(LIMIT)) {
      run_inline(ctx, fn, n);  // nested, or nothing to share
      return;
    }
    std::unique_lock<std::mutex> lock(run_mutex_, std::try_to_lock);
    if (!lock.owns_lock()) {
      run_inline(ctx, fn, n);  // another thread's region is running: this one runs on its caller
      return;
    }
    fn_ = fn;
    ctx_ = ctx;
    n_ = n;
    chunk_ = chunk;
    chunks_ = static_cast<uint32_t>(chunks);
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    const uint32_t epoch = epoch_word_.load(std::memory_order_relaxed) + 1;
    ticket_.store((uint64_t(epoch) << 32) | (LIMIT - uint64_t(chunks)), std::memory_order_release);
    epoch_word_.store(epoch, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake(&epoch_word_, INT_MAX);
    regions_.fetch_add(1, std::memory_order_relaxed);
    caller_chunks_.fetch_add(take_chunks(), std::memory_order_relaxed);
    wait_done();
    if (error_) std::rethrow_exception(error_);
  }

  // Counters for tests and measurements: regions shared, chunks the caller ran, times the caller slept.
  std::vector<int64_t> counters() const {
    return {regions_.load(), caller_chunks_.load(), caller_sleeps_.load(), static_cast<int64_t>(workers_.size())};
  }

 private:
  static void run_inline(void* ctx, ChunkFn fn, int64_t n) {
    const bool was = t_inside;
    t_inside = true;
    try {
      fn(ctx, 0, n);
    } catch (...) {
      t_inside = was;
      throw;
    }
    t_inside = was;
  }

  // Takes and runs chunks of the current region until none is left -> how many this thread ran.
  int64_t take_chunks() {
    int64_t ran = 0;
    for (;;) {
      const uint64_t claim = ticket_.fetch_add(1, std::memory_order_acq_rel);
      const uint64_t index = claim & 0xffffffffu;
      if (index >= LIMIT) return ran;
      const uint32_t total = chunks_;  // the region is stable: a chunk of it is ours and not yet done
      const int64_t c = static_cast<int64_t>(index - (LIMIT - total));
      const int64_t begin = c * chunk_, end = std::min(n_, begin + chunk_);
      t_inside = true;
      try {
        fn_(ctx_, begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      t_inside = false;
      ++ran;
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == total &&
          caller_sleeping_.load(std::memory_order_seq_cst))
        futex_wake(&done_, 1);
    }
  }

  void wait_done() {
    const uint32_t chunks = chunks_;
    if (spin_while([&] { return done_.load(std::memory_order_acquire) != chunks; }, spin_us())) return;
    caller_sleeps_.fetch_add(1, std::memory_order_relaxed);
    for (;;) {
      caller_sleeping_.store(true, std::memory_order_seq_cst);
      const uint32_t seen = done_.load(std::memory_order_seq_cst);
      if (seen == chunks) break;
      futex_wait(&done_, seen);
    }
    caller_sleeping_.store(false, std::memory_order_relaxed);
  }

  void work(int index) {
    uint32_t seen = epoch_word_.load();
    while (!stopping_.load()) {
      if (index >= threads()) {  // not in use: sleep until set_threads changes
        const uint32_t word = threads_word_.load(std::memory_order_seq_cst);
        if (index >= threads() && !stopping_.load()) futex_wait(&threads_word_, word);
        seen = epoch_word_.load();
        continue;
      }
      if (!spin_while([&] { return epoch_word_.load(std::memory_order_acquire) == seen; }, spin_us())) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while (epoch_word_.load(std::memory_order_seq_cst) == seen && !stopping_.load() && index < threads())
          futex_wait(&epoch_word_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      seen = epoch_word_.load(std::memory_order_acquire);
      take_chunks();
    }
  }

  std::atomic<uint64_t> ticket_{LIMIT};  // epoch 0, no chunk left
  std::atomic<uint32_t> epoch_word_{0};  // the current region's epoch (futex: idle workers sleep on it)
  std::atomic<uint32_t> done_{0};        // chunks of the current region run (futex: the caller sleeps on it)
  std::atomic<uint32_t> threads_word_{0};  // bumped by set_threads (futex: workers not in use sleep on it)
  std::atomic<int> sleepers_{0};
  std::atomic<bool> caller_sleeping_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<int> threads_{1};
  std::atomic<int64_t> spin_us_{SPIN_US};
  std::atomic<int64_t> chunks_per_thread_{CHUNKS_PER_THREAD};
  // The current region (written by the caller before the ticket is published; read after a valid claim).
  ChunkFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  uint32_t chunks_ = 0;
  std::exception_ptr error_;
  std::mutex error_mutex_, run_mutex_;
  std::vector<std::thread> workers_;
  std::atomic<int64_t> regions_{0}, caller_chunks_{0}, caller_sleeps_{0};
};

// The process's pool: made on first use and never destroyed (workers may outlive module teardown at exit).
Pool& pool() {
  static Pool* p = new Pool();
  return *p;
}

void api_run(void* ctx, ChunkFn fn, int64_t n, int64_t grain) { pool().run(ctx, fn, n, grain); }
int api_threads() { return pool().threads(); }

const PoolApi API = {&api_run, &api_threads};

// Test hook: a region over out's n items (chunks of at least `grain`) that adds 1 to every item it runs, so a test
// sees every item run exactly once whatever the threads did; the chunk starting at item b first sleeps
// `sleep_us[(b / grain) % len]` microseconds (a negative value: it throws instead).
void test_region(at::Tensor out, int64_t grain, std::vector<int64_t> sleep_us) {
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t n = out.numel();
  auto body = [&](int64_t begin, int64_t end) {
    if (!sleep_us.empty()) {
      const int64_t us = sleep_us[(begin / grain) % static_cast<int64_t>(sleep_us.size())];
      if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
      TORCH_CHECK(us >= 0, "test_region: the chunk at ", begin, " throws, as asked");
    }
    for (int64_t i = begin; i < end; ++i) o[i] += 1;
  };
  api_run(&body, [](void* ctx, int64_t b, int64_t e) { (*static_cast<decltype(body)*>(ctx))(b, e); }, n, grain);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("api_address", [] { return reinterpret_cast<int64_t>(&API); }, "the pool's PoolApi table (pool_api.h)");
  m.def("set_threads", [](int n) { pool().set_threads(n); }, "threads a region runs on (the caller included)");
  m.def("threads", [] { return pool().threads(); });
  m.def("set_spin_us", [](int64_t us) { pool().set_spin_us(us); }, "how long an idle thread spins before sleeping");
  m.def("spin_us", [] { return pool().spin_us(); });
  m.def("set_chunks_per_thread", [](int64_t c) { pool().set_chunks_per_thread(c); },
        "chunks a region is cut into per thread (at least; fewer where its grain asks for larger ones)");
  m.def("counters", [] { return pool().counters(); }, "[regions shared, chunks the caller ran, caller sleeps, workers]");
  m.def("test_region", &test_region);
}
