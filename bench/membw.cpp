// The machine's memory read bandwidth, the floor under a decode step (which
// reads every weight once): bench/decode_bench.py compiles and runs it.
// Each of T threads sums 64-bit words of its own part of a buffer far larger
// than the caches (default 1 GiB, filled first so the pages exist); the best
// of R passes, all T threads together, in GB/s (10^9 bytes). One line of
// JSON per thread count:
//   {"threads": 2, "gbs": 21.3}
//   g++ -O3 -march=native -pthread bench/membw.cpp -o membw && ./membw 1024 5 1 2
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

uint64_t sum_words(const uint64_t* p, size_t n) {
  // Four independent accumulators: the loop is bound by loads, not by the
  // add chain (the compiler vectorizes it at -O3).
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i + 4 <= n; i += 4) {
    a += p[i];
    b += p[i + 1];
    c += p[i + 2];
    d += p[i + 3];
  }
  return a + b + c + d;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  const size_t words = mib * (size_t{1} << 20) / sizeof(uint64_t);
  std::vector<uint64_t> buf(words);
  for (size_t i = 0; i < words; ++i) buf[i] = i;
  volatile uint64_t sink = 0;
  for (int a = 3; a < argc || a == 3; ++a) {
    const int threads = argc > a ? std::atoi(argv[a]) : 1;
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      std::vector<uint64_t> part(threads);
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::thread> pool;
      const size_t per = words / threads;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] { part[t] = sum_words(buf.data() + t * per, per); });
      }
      for (auto& th : pool) th.join();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      for (uint64_t v : part) sink = sink + v;
      if (s < best) best = s;
    }
    std::printf("{\"threads\": %d, \"gbs\": %.2f, \"mib\": %zu}\n", threads,
                static_cast<double>(words / threads * threads * sizeof(uint64_t)) / best / 1e9, mib);
  }
  return sink == 42 ? 1 : 0;
}
