// Native state of one VirtualRange: a reservation and its page table.
// Physical budgets are charged above it (kvcached/budget.py). Shared (std::shared_ptr) between the Python object and
// every DLPack view, so the address space outlives whichever goes last.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <sys/types.h>

#include "backend.h"

namespace kvcached {

class RangeState {
 public:
  RangeState(const std::string& device, std::int64_t size, std::int64_t page_size);
  // Unmaps whatever is still mapped and frees the reservation; never throws. In a
  // forked child it leaves the pages alone (see owner_pid_).
  ~RangeState();
  RangeState(const RangeState&) = delete;
  RangeState& operator=(const RangeState&) = delete;

  // All-or-nothing: either every page ends up mapped or none of them does.
  void map(const std::vector<std::int64_t>& pages);
  // Validates every index first, then unmaps and returns the memory.
  void unmap(const std::vector<std::int64_t>& pages);
  bool is_mapped(std::int64_t page);
  std::vector<std::int64_t> mapped_pages();
  std::size_t num_mapped();
  // Unmaps everything; the reservation itself lives until the last view is gone.
  void close();
  bool closed();

  std::size_t physical_available();
  std::size_t committed_bytes();

  // Checks a byte window for a view and returns its length (nbytes -1 = to the end).
  std::size_t view_length(std::int64_t offset, std::int64_t nbytes);

  std::string device() const { return backend_->device_string(); }
  int dl_device_type() const noexcept { return backend_->dl_device_type(); }
  int device_id() const noexcept { return backend_->device_id(); }
  std::uintptr_t address() const noexcept { return base_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t page_size() const noexcept { return page_size_; }
  std::size_t num_pages() const noexcept { return size_ / page_size_; }

  // Number of DLPack views (capsules or tensors made from them) still alive.
  std::atomic<std::int64_t> live_views{0};

 private:
  // Throws InvariantError unless open and called by the process that created the range.
  void check_open() const;
  std::size_t checked_index(std::int64_t page) const;
  // Validates a whole batch before any change: every index in range, none twice, and
  // every page mapped (want_mapped) or unmapped (!want_mapped). Throws InvariantError.
  void check_batch_locked(const std::vector<std::int64_t>& pages, bool want_mapped, const char* op) const;
  void map_one_locked(std::size_t page);
  void unmap_one_locked(std::size_t page);
  void coalesce_after_fallbacks_locked(const std::vector<std::int64_t>& pages, std::size_t count) noexcept;

  std::mutex mu_;
  std::unique_ptr<Backend> backend_;
  // The process that created the range. A forked child shares its memfd (CPU): if
  // the child unmapped a page, punching the hole would zero the parent's live page.
  // So the child may read views it inherited, but never map, unmap or close.
  pid_t owner_pid_ = 0;
  std::uintptr_t base_ = 0;
  std::size_t size_ = 0;
  std::size_t page_size_ = 0;
  std::vector<std::uint8_t> mapped_;
  std::size_t num_mapped_ = 0;
  bool closed_ = false;
};

}  // namespace kvcached
