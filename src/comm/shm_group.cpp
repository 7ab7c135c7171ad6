#include "comm/shm_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <new>
#include <random>
#include <thread>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

// NOTE: [Shared-memory collectives]
// Gloo over loopback TCP costs ~1.5 ms per small collective on a 2-vCPU VM,
// more than a whole decode step of a small model. Ranks of one host instead
// share one POSIX shared-memory segment per group:
//
//   header | per rank: arrival word, pid | buffer 0: W slots | buffer 1: W slots
//
// A collective (number `seq` on this group's shared-memory path, the same
// on every member) is one-shot: each rank copies its input into its slot of
// buffer seq % 2, publishes seq in its arrival word, waits until every
// member's word reached seq, then reads what it needs from all slots. Sums
// go in rank order 0, 1, 2, ... on every rank, so every rank gets the same
// bits. Two buffers make this safe without a second barrier: a rank writes
// buffer seq % 2 again only at seq + 2, after it saw every member arrive at
// seq + 1, which each did after it finished reading collective seq.
//
// Each rank also publishes a hash of its call (collective, dtype, sizes,
// op, root) with its arrival; a member whose call differs fails every rank
// with an error instead of reading sizes its peers did not write.
//
// Waiting spins for a few microseconds, then sleeps on the arrival word
// (futex; every arrival wakes its sleepers), checking the deadline
// (DTP_TIMEOUT_S) and whether each missing member's process still exists.
//
// Setup goes through the group's store: group rank 0 creates the segment
// under a random name and publishes it with a random token; every member
// maps it and checks the token (a rank on another host finds no such
// segment), says whether it could; rank 0 unlinks the name once all have
// answered. From then on the segment has no name: nothing is left in
// /dev/shm however the ranks end (killed included), and the memory goes
// when the last rank unmaps it. Members use it only if all of them could.

namespace dtp::detail {

// One rank's line of the header (a cache line of its own).
struct alignas(64) ShmRankLine {
  std::atomic<uint32_t> arrived;
  int32_t pid;
  uint64_t call[2];  // what this rank's collective seq is, at [seq % 2]: see arrive_and_wait
  std::atomic<uint32_t> failed;  // set by abort(); zero in a new segment
};

namespace {

constexpr uint64_t kMagic = 0x6474702d73686d31ull;  // "dtp-shm1"
constexpr size_t kLine = sizeof(ShmRankLine);


struct Header {
  uint64_t magic;
  uint64_t token;
  int64_t size, slot_bytes;
};

size_t roundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }
size_t headerBytes(int size) { return roundUp(kLine + static_cast<size_t>(size) * sizeof(ShmRankLine), 4096); }
size_t segmentBytes(int size, int64_t slot) { return headerBytes(size) + 2 * static_cast<size_t>(size) * slot; }

void futexWait(std::atomic<uint32_t>* word, uint32_t seen, long ns) {
  timespec ts{0, ns};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}
void futexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

bool shmDisabled() {
  const char* v = std::getenv("DTP_SHM");
  return v != nullptr && std::string(v) == "0";
}

std::string errnoText(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// A process that no longer exists, or has exited and waits for its parent to
// reap it (a zombie still answers kill(pid, 0)).
bool processGone(int32_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() && (text[paren + 2] == 'Z' || text[paren + 2] == 'X');
}

}  // namespace

namespace {
thread_local const std::string* host_key_override = nullptr;
}

std::string host_key() {
  if (host_key_override != nullptr) return *host_key_override;
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  struct stat st {};
  stat("/dev/shm", &st);
  return c10::str(name, "/", boot, "/", static_cast<uint64_t>(st.st_dev), ":", static_cast<uint64_t>(st.st_ino));
}

HostKeyOverride::HostKeyOverride(std::string key) : key_(std::move(key)) { host_key_override = &key_; }
HostKeyOverride::~HostKeyOverride() { host_key_override = nullptr; }

int64_t shm_max_bytes() {
  const char* v = std::getenv("DTP_SHM_MAX_BYTES");
  if (v == nullptr || *v == '\0') return kShmDefaultMaxBytes;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0' && n >= 4096 && n <= (int64_t{1} << 30), "dtp: DTP_SHM_MAX_BYTES='", v,
              "' is not a byte count in [4096, 2^30]. Unset it for the default (", kShmDefaultMaxBytes, ").");
  return static_cast<int64_t>(roundUp(static_cast<size_t>(n), 4096));
}

std::shared_ptr<ShmGroup> ShmGroup::connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                            std::chrono::milliseconds timeout) {
  const int64_t slot = shm_max_bytes();
  const size_t bytes = segmentBytes(size, slot);
  std::string name, why;
  uint64_t token = 0;
  void* base = MAP_FAILED;
  if (rank == 0) {
    if (!shmDisabled()) {
      std::random_device rd;
      token = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
      char buf[64];
      std::snprintf(buf, sizeof buf, "/dtp-%d-%016llx", static_cast<int>(getpid()),
                    static_cast<unsigned long long>(token));
      name = buf;
      const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        why = errnoText("shm_open");
        name.clear();
      } else {
        // Reserve the pages now: a full /dev/shm then fails here, not with SIGBUS mid-collective.
        const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
        if (err != 0) {
          errno = err;
          why = errnoText("posix_fallocate") + " (" + std::to_string(bytes >> 20) + " MiB in /dev/shm)";
        } else {
          base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
          if (base == MAP_FAILED) why = errnoText("mmap");
        }
        close(fd);
        if (base == MAP_FAILED) {
          shm_unlink(name.c_str());
          name.clear();
        } else {
          new (base) Header{kMagic, token, size, slot};
        }
      }
    }
    const std::string published = name.empty() ? std::string() : name + " " + std::to_string(token);
    store->set("shm/name", std::vector<uint8_t>(published.begin(), published.end()));
    const std::string host = host_key();
    store->set("shm/host", std::vector<uint8_t>(host.begin(), host.end()));
  } else {
    const auto got = store->get("shm/name");
    const std::string published(got.begin(), got.end());
    const auto space = published.find(' ');
    const auto host = store->get("shm/host");
    // Another host by its key (a rank of the same process or machine may
    // still open the segment: ranks as threads in tests, containers sharing
    // /dev/shm), so that host identity is one thing for both paths.
    const bool same_host = std::string(host.begin(), host.end()) == host_key();
    if (!shmDisabled() && space != std::string::npos && same_host) {
      name = published.substr(0, space);
      token = std::stoull(published.substr(space + 1));
      const int fd = shm_open(name.c_str(), O_RDWR, 0600);
      struct stat st {};
      if (fd >= 0 && fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes)
        base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (fd >= 0) close(fd);
      if (base != MAP_FAILED) {
        const auto* h = static_cast<const Header*>(base);
        if (h->magic != kMagic || h->token != token || h->size != size || h->slot_bytes != slot) {
          munmap(base, bytes);
          base = MAP_FAILED;
        }
      }
    }
  }
  if (base != MAP_FAILED) {
    auto* line = reinterpret_cast<ShmRankLine*>(static_cast<uint8_t*>(base) + kLine) + rank;
    line->pid = static_cast<int32_t>(getpid());
  }
  store->set("shm/ok/" + std::to_string(rank), std::vector<uint8_t>{static_cast<uint8_t>(base != MAP_FAILED)});
  bool all = true;
  for (int r = 0; r < size; ++r) all = store->get("shm/ok/" + std::to_string(r)).at(0) == 1 && all;
  if (rank == 0 && !name.empty()) shm_unlink(name.c_str());  // every member has mapped it, or never will
  if (!all) {
    if (base != MAP_FAILED) munmap(base, bytes);
    if (rank == 0 && !why.empty())
      std::cerr << "dtp: shared-memory collectives are off for a group of " << size << " ranks (" << why
                << "); Gloo carries its CPU collectives. DTP_SHM_MAX_BYTES sets the slot size, DTP_SHM=0 silences "
                   "this.\n";
    return nullptr;
  }
  return std::shared_ptr<ShmGroup>(new ShmGroup(rank, size, base, bytes, slot, timeout));
}

ShmGroup::ShmGroup(int rank, int size, void* base, size_t bytes, int64_t slot_bytes, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), base_(base), bytes_(bytes), slot_bytes_(slot_bytes), timeout_(timeout) {}

ShmGroup::~ShmGroup() { munmap(base_, bytes_); }


uint8_t* ShmGroup::slot(int rank, uint32_t seq) const {
  return static_cast<uint8_t*>(base_) + headerBytes(size_) +
         (static_cast<size_t>(seq & 1) * size_ + rank) * static_cast<size_t>(slot_bytes_);
}

ShmRankLine& ShmGroup::line(int rank) const {
  return *(reinterpret_cast<ShmRankLine*>(static_cast<uint8_t*>(base_) + kLine) + rank);
}

void ShmGroup::arrive_and_wait(uint32_t seq, uint64_t call) {
  std::atomic<uint32_t>& mine = line(rank_).arrived;
  line(rank_).call[seq & 1] = call;
  mine.store(seq, std::memory_order_release);
  futexWake(&mine);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto next_check = start + std::chrono::milliseconds(20);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    std::atomic<uint32_t>& word = line(r).arrived;
    for (int spins = 0;; ++spins) {
      const uint32_t seen = word.load(std::memory_order_acquire);
      TORCH_CHECK(line(r).failed.load(std::memory_order_acquire) == 0, "shared-memory collective: group rank ", r,
                  " (pid ", line(r).pid, ") failed in an earlier step of this collective (between hosts: see its "
                  "error) and left it: Connection closed");
      if (static_cast<int32_t>(seen - seq) >= 0) {
        TORCH_CHECK(line(r).call[seq & 1] == call, "shared-memory collective: the ranks disagree on a collective's "
                    "shapes (group rank ", r, " called it with other sizes, dtype or op than group rank ", rank_,
                    "). Rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL to see each rank's call; from_local without "
                    "run_check is a usual cause");
        break;
      }
      if (spins < 2048) {
        relax();
        continue;
      }
      futexWait(&word, seen, 1000000);
      const auto now = Clock::now();
      if (now < next_check) continue;
      next_check = now + std::chrono::milliseconds(20);
      const int32_t pid = line(r).pid;
      if (processGone(pid))
        TORCH_CHECK(false, "shared-memory collective: group rank ", r, "'s process (pid ", pid,
                    ") is gone: Connection closed");
      TORCH_CHECK(now - start < timeout_, "shared-memory collective: nothing came from group rank ", r, " (pid ", pid,
                  "): timed out after ", timeout_.count() / 1000, " s");
    }
  }
}

uint64_t shm_call_hash(std::initializer_list<int64_t> words, const std::vector<int64_t>& sizes) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](int64_t w) {
    for (int i = 0; i < 8; ++i) h = (h ^ ((static_cast<uint64_t>(w) >> (8 * i)) & 0xff)) * 1099511628211ull;
  };
  for (int64_t w : words) mix(w);
  for (int64_t w : sizes) mix(w);
  return h;
}

namespace {

at::Tensor viewOf(uint8_t* p, int64_t numel, const at::Tensor& like) {
  return at::from_blob(p, {numel}, like.options());
}

// acc = v[0] op v[1] op ... in rank order (v.size() >= 2).
void reduceInto(at::Tensor& acc, const std::vector<at::Tensor>& v, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      at::add_out(acc, v[0], v[1]);
      for (size_t r = 2; r < v.size(); ++r) acc.add_(v[r]);
      if (op == ReduceOp::Avg) acc.div_(static_cast<int64_t>(v.size()));
      break;
    case ReduceOp::Max:
      at::maximum_out(acc, v[0], v[1]);
      for (size_t r = 2; r < v.size(); ++r) at::maximum_out(acc, acc, v[r]);
      break;
    case ReduceOp::Min:
      at::minimum_out(acc, v[0], v[1]);
      for (size_t r = 2; r < v.size(); ++r) at::minimum_out(acc, acc, v[r]);
      break;
  }
}

}  // namespace

uint32_t ShmGroup::publish(const at::Tensor& input, uint64_t call) {
  const uint32_t seq = ++seq_;
  if (input.defined()) {
    const int64_t bytes = input.numel() * input.element_size();
    TORCH_INTERNAL_ASSERT(input.is_contiguous() && bytes <= slot_bytes_);
    std::memcpy(slot(rank_, seq), input.data_ptr(), bytes);
  }
  arrive_and_wait(seq, call);
  return seq;
}

void ShmGroup::all_reduce(at::Tensor& flat, ReduceOp op) {
  const uint32_t seq =
      publish(flat, shm_call_hash({1, static_cast<int64_t>(flat.scalar_type()), flat.numel(), static_cast<int64_t>(op)}));
  std::vector<at::Tensor> views;
  for (int r = 0; r < size_; ++r) views.push_back(viewOf(slot(r, seq), flat.numel(), flat));
  reduceInto(flat, views, op);
}

void ShmGroup::all_gather(const at::Tensor& flat, const std::vector<int64_t>& numels, at::Tensor& out) {
  const int64_t el = flat.element_size();
  TORCH_INTERNAL_ASSERT(flat.numel() == numels[rank_]);
  const uint32_t seq = publish(flat, shm_call_hash({2, static_cast<int64_t>(flat.scalar_type())}, numels));
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for (int r = 0; r < size_; ++r) {
    std::memcpy(dst, slot(r, seq), numels[r] * el);
    dst += numels[r] * el;
  }
}

at::Tensor ShmGroup::reduce_scatter(const at::Tensor& flat, const std::vector<int64_t>& numels, ReduceOp op) {
  const int64_t el = flat.element_size();
  int64_t offset = 0;
  for (int r = 0; r < rank_; ++r) offset += numels[r];
  const uint32_t seq =
      publish(flat, shm_call_hash({3, static_cast<int64_t>(flat.scalar_type()), static_cast<int64_t>(op)}, numels));
  at::Tensor out = at::empty({numels[rank_]}, flat.options());
  if (numels[rank_] == 0) return out;
  std::vector<at::Tensor> views;
  for (int r = 0; r < size_; ++r) views.push_back(viewOf(slot(r, seq) + offset * el, numels[rank_], flat));
  reduceInto(out, views, op);
  return out;
}

void ShmGroup::broadcast(at::Tensor& flat, int src) {
  const int64_t bytes = flat.numel() * flat.element_size();
  TORCH_INTERNAL_ASSERT(flat.is_contiguous() && bytes <= slot_bytes_);
  const uint32_t seq = publish(rank_ == src ? flat : at::Tensor(), shm_call_hash({4, bytes, src}));
  if (rank_ != src) std::memcpy(flat.data_ptr(), slot(src, seq), bytes);
}

void ShmGroup::barrier() { publish(at::Tensor(), shm_call_hash({5})); }

void ShmGroup::abort() {
  line(rank_).failed.store(1, std::memory_order_release);
  futexWake(&line(rank_).arrived);  // those asleep on this rank's word look again
}

void ShmGroup::reduce(at::Tensor& flat, ReduceOp op, int root) {
  const uint32_t seq = publish(
      flat, shm_call_hash({6, static_cast<int64_t>(flat.scalar_type()), flat.numel(), static_cast<int64_t>(op), root}));
  if (rank_ != root) return;
  std::vector<at::Tensor> views;
  for (int r = 0; r < size_; ++r) views.push_back(viewOf(slot(r, seq), flat.numel(), flat));
  reduceInto(flat, views, op);
}

void ShmGroup::gather(const at::Tensor& flat, const std::vector<int64_t>& numels, at::Tensor& out, int root) {
  const int64_t el = flat.element_size();
  TORCH_INTERNAL_ASSERT(flat.numel() == numels[rank_]);
  const uint32_t seq = publish(flat, shm_call_hash({7, static_cast<int64_t>(flat.scalar_type()), root}, numels));
  if (rank_ != root) return;
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for (int r = 0; r < size_; ++r) {
    std::memcpy(dst, slot(r, seq), numels[r] * el);
    dst += numels[r] * el;
  }
}

at::Tensor ShmGroup::scatter(const at::Tensor& flat, const std::vector<int64_t>& numels, int root,
                             const at::TensorOptions& options) {
  int64_t offset = 0;
  for (int r = 0; r < rank_; ++r) offset += numels[r];
  const uint32_t seq =
      publish(rank_ == root ? flat : at::Tensor(), shm_call_hash({8, static_cast<int64_t>(options.dtype().toScalarType()), root}, numels));
  at::Tensor out = at::empty({numels[rank_]}, options);
  if (numels[rank_] > 0)
    std::memcpy(out.data_ptr(), slot(root, seq) + offset * out.element_size(), numels[rank_] * out.element_size());
  return out;
}

}  // namespace dtp::detail
