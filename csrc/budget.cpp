#include "budget.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "errors.h"

namespace kvcached {

namespace {

constexpr std::uint64_t kMagic = 0x6b76636275640002ULL;  // arbitrary tag + layout version 2
static_assert(sizeof(Budget::Arena) <= Budget::kArenaBytes, "arena fits one page");

void check_limit(std::int64_t limit) {
  if (limit < 0) throw_config("Budget limit must be >= 0 bytes, got " + std::to_string(limit));
}

std::uint64_t load(const std::uint64_t* p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }

void sub_clamped(std::uint64_t* p, std::uint64_t n) {
  std::uint64_t cur = load(p);
  for (;;) {
    std::uint64_t next = n > cur ? 0 : cur - n;
    if (__atomic_compare_exchange_n(p, &cur, next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return;
  }
}

bool process_gone(std::int32_t pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

}  // namespace

Budget::Budget(std::int64_t limit, const std::string& path) : path_(path) {
  check_limit(limit);
  if (path.empty()) {
    a_ = new Arena{};
    a_->magic = kMagic;
    a_->limit = static_cast<std::uint64_t>(limit);
    return;
  }
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) throw_os("open budget file '" + path + "'", errno);
  // The lock only serialises opening, so two processes creating the arena at
  // once cannot both initialise it; charging itself is lock-free.
  if (flock(fd, LOCK_EX) != 0) {
    int err = errno;
    close(fd);
    throw_os("flock budget file '" + path + "'", err);
  }
  void* p = MAP_FAILED;
  try {
    struct stat st;
    if (fstat(fd, &st) != 0) throw_os("fstat budget file '" + path + "'", errno);
    bool fresh = st.st_size == 0;
    if (fresh && ftruncate(fd, kArenaBytes) != 0) throw_os("ftruncate budget file '" + path + "'", errno);
    if (!fresh && static_cast<std::size_t>(st.st_size) < kArenaBytes) {
      throw_config("'" + path + "' is not a kvcached budget file (wrong size)");
    }
    p = mmap(nullptr, kArenaBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw_os("mmap budget file '" + path + "'", errno);
    auto* a = static_cast<Arena*>(p);
    if (fresh) {
      __atomic_store_n(&a->limit, static_cast<std::uint64_t>(limit), __ATOMIC_SEQ_CST);
      __atomic_store_n(&a->magic, kMagic, __ATOMIC_SEQ_CST);
    } else if (load(&a->magic) != kMagic) {
      throw_config("'" + path + "' is not a kvcached budget file (bad magic)");
    } else if (limit > 0) {
      __atomic_store_n(&a->limit, static_cast<std::uint64_t>(limit), __ATOMIC_SEQ_CST);
    }
    a_ = a;
  } catch (...) {
    if (p != MAP_FAILED) munmap(p, kArenaBytes);
    flock(fd, LOCK_UN);
    close(fd);
    throw;
  }
  shared_ = true;
  fd_ = fd;
  reclaim_dead();
  claim_slot();
  flock(fd, LOCK_UN);
}

Budget::~Budget() {
  if (!shared_) {
    delete a_;
    return;
  }
  // Ranges hold the budget alive, so every charge was refunded by now; a
  // leftover (a range that could not unmap) stays counted in `used`.
  if (Slot* s = my_slot()) {
    __atomic_store_n(&s->bytes, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&s->pid, 0, __ATOMIC_SEQ_CST);
  }
  munmap(a_, kArenaBytes);
  close(fd_);
}

void Budget::claim_slot() noexcept {
  pid_t me = getpid();
  for (std::size_t i = 0; i < kSlots; ++i) {
    std::int32_t expected = 0;
    if (__atomic_compare_exchange_n(&a_->slots[i].pid, &expected, me, false, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST)) {
      __atomic_store_n(&a_->slots[i].bytes, 0, __ATOMIC_SEQ_CST);
      slot_ = &a_->slots[i];
      slot_pid_ = me;
      return;
    }
  }
  // All slots taken: charges still work, they just cannot be reclaimed if we die.
}

Budget::Slot* Budget::my_slot() noexcept {
  return (slot_ != nullptr && slot_pid_ == getpid()) ? slot_ : nullptr;
}

std::uint64_t Budget::reclaim_dead() noexcept {
  if (!shared_) return 0;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < kSlots; ++i) {
    Slot& s = a_->slots[i];
    std::int32_t pid = __atomic_load_n(&s.pid, __ATOMIC_SEQ_CST);
    if (pid <= 0 || !process_gone(pid)) continue;
    // Only the process that wins this exchange reclaims the slot.
    if (!__atomic_compare_exchange_n(&s.pid, &pid, -1, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
      continue;
    }
    std::uint64_t bytes = __atomic_exchange_n(&s.bytes, 0, __ATOMIC_SEQ_CST);
    sub_clamped(&a_->used, bytes);
    total += bytes;
    __atomic_store_n(&s.pid, 0, __ATOMIC_SEQ_CST);
  }
  return total;
}

bool Budget::try_acquire(std::uint64_t n) noexcept {
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::uint64_t used = load(&a_->used);
    for (;;) {
      std::uint64_t limit = load(&a_->limit);
      if (used > limit || n > limit - used) break;
      // On failure `used` is refreshed with the current value and we retry.
      if (__atomic_compare_exchange_n(&a_->used, &used, used + n, false, __ATOMIC_SEQ_CST,
                                      __ATOMIC_SEQ_CST)) {
        if (Slot* s = my_slot()) __atomic_add_fetch(&s->bytes, n, __ATOMIC_SEQ_CST);
        return true;
      }
    }
    // Full: memory held by dead processes may be what is missing.
    if (attempt == 0 && reclaim_dead() == 0) return false;
  }
  return false;
}

void Budget::release(std::uint64_t n) noexcept {
  if (Slot* s = my_slot()) sub_clamped(&s->bytes, n);
  sub_clamped(&a_->used, n);
}

std::uint64_t Budget::limit() const noexcept { return load(&a_->limit); }

void Budget::set_limit(std::int64_t limit) {
  check_limit(limit);
  __atomic_store_n(&a_->limit, static_cast<std::uint64_t>(limit), __ATOMIC_SEQ_CST);
}

std::uint64_t Budget::used() const noexcept { return load(&a_->used); }

std::uint64_t Budget::available() const noexcept {
  std::uint64_t limit = this->limit();
  std::uint64_t used = this->used();
  return used >= limit ? 0 : limit - used;
}

}  // namespace kvcached
