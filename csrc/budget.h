// Physical-byte budget for the CPU backend.
//
// Host memory has no natural "device full" point, so a Budget provides one:
// every mapped page is charged before it is mapped and refunded after it is
// unmapped. A Budget with a path lives in a small shared file, so several
// processes draw from one pool exactly like several processes sharing a GPU.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvcached {

class Budget {
 public:
  // path == "": counters live in this process, limit = `limit`.
  // Otherwise the arena file is created (mode 0600) if missing and mapped
  // shared. A new arena starts with limit = `limit`; opening an existing one
  // keeps its usage, and a positive `limit` replaces its limit while 0 means
  // "attach with whatever limit the arena already has".
  Budget(std::int64_t limit, const std::string& path);
  ~Budget();
  Budget(const Budget&) = delete;
  Budget& operator=(const Budget&) = delete;

  // Charges n bytes if they fit under the limit; false (and no change) if not.
  bool try_acquire(std::uint64_t n) noexcept;
  // Refunds n bytes (clamped at zero so a bug cannot wrap the counter).
  void release(std::uint64_t n) noexcept;

  std::uint64_t limit() const noexcept;
  void set_limit(std::int64_t limit);
  std::uint64_t used() const noexcept;
  std::uint64_t available() const noexcept;
  const std::string& path() const noexcept { return path_; }

  // Returns the charges of processes that died without refunding them (a real
  // device frees a dead process's memory too). Returns the bytes reclaimed.
  std::uint64_t reclaim_dead() noexcept;

  // Layout of the arena (one 4 KiB page). Each process attached to a shared
  // arena records its own charge in a slot so that survivors can reclaim it.
  struct Slot {
    std::int32_t pid;  // 0 = free, -1 = being reclaimed
    std::uint32_t pad;
    std::uint64_t bytes;
  };
  static constexpr std::size_t kArenaBytes = 4096;
  static constexpr std::size_t kSlots = (kArenaBytes - 3 * sizeof(std::uint64_t)) / sizeof(Slot);
  struct Arena {
    std::uint64_t magic;
    std::uint64_t limit;
    std::uint64_t used;  // sum of all charges, the number admission looks at
    Slot slots[kSlots];
  };

 private:
  void claim_slot() noexcept;
  Slot* my_slot() noexcept;

  Arena* a_ = nullptr;
  bool shared_ = false;
  int fd_ = -1;
  Slot* slot_ = nullptr;  // our slot in a shared arena (null if all were taken)
  pid_t slot_pid_ = 0;    // charges made after fork() are not attributed to the parent
  std::string path_;
};

}  // namespace kvcached
