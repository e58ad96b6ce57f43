#include "vrange.h"

#include <unistd.h>

#include <algorithm>

#include "cpu_backend.h"
#include "cuda_backend.h"
#include "errors.h"

namespace kvcached {

namespace {

// "cpu" -> -1, "cuda" -> 0, "cuda:N" -> N; anything else is a ConfigError.
int parse_device(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  const std::string prefix = "cuda:";
  if (device.compare(0, prefix.size(), prefix) == 0 && device.size() > prefix.size() &&
      device.size() <= prefix.size() + 6) {
    std::string digits = device.substr(prefix.size());
    if (std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return std::stoi(digits);
    }
  }
  throw_config("device must be 'cpu', 'cuda' or 'cuda:N', got '" + device + "'");
}

std::string page_name(std::size_t page) { return "page " + std::to_string(page); }

}  // namespace

RangeState::RangeState(const std::string& device, std::int64_t size, std::int64_t page_size)
    : owner_pid_(getpid()) {
  int dev = parse_device(device);
  if (page_size <= 0) throw_config("page_size must be positive, got " + std::to_string(page_size));
  if (size <= 0) throw_config("size must be positive, got " + std::to_string(size));
  if (size % page_size != 0) {
    throw_config("size " + std::to_string(size) + " is not a multiple of page_size " +
                 std::to_string(page_size));
  }
  std::size_t unit = dev < 0 ? os_page_size() : cuda::granularity(dev);
  if (static_cast<std::size_t>(page_size) % unit != 0) {
    throw_config("page_size " + std::to_string(page_size) + " is not a multiple of the " +
                 (dev < 0 ? std::string("OS page size ") : std::string("CUDA granularity ")) +
                 std::to_string(unit));
  }
  page_size_ = static_cast<std::size_t>(page_size);
  size_ = static_cast<std::size_t>(size);
  if (dev < 0) {
    backend_ = std::make_unique<CpuBackend>(page_size_);
  } else {
    backend_ = std::make_unique<CudaBackend>(dev, page_size_);
  }
  base_ = backend_->reserve(size_);
  mapped_.assign(num_pages(), 0);
}

RangeState::~RangeState() {
  // Best effort only: a destructor must neither throw nor print (it may run
  // at interpreter exit). Pages whose unmap fails are reclaimed with the
  // reservation below (munmap / process exit). A forked child frees only its own
  // copy of the address space: the pages are the parent's.
  if (getpid() != owner_pid_) {
    // CPU: unmapping our copy of the VA and closing our copy of the memfd touch
    // nothing of the parent's. CUDA: a forked child may not call the driver.
    if (backend_->dl_device_type() == 1) {
      backend_.reset();
    } else {
      (void)backend_.release();
    }
    return;
  }
  for (std::size_t p = 0; p < mapped_.size(); ++p) {
    if (!mapped_[p]) continue;
    try {
      unmap_one_locked(p);
    } catch (...) {
    }
  }
  backend_.reset();  // frees the reservation
}

void RangeState::check_open() const {
  if (closed_) throw_invariant("VirtualRange is closed");
  if (getpid() != owner_pid_) {
    throw_invariant("VirtualRange belongs to process " + std::to_string(owner_pid_) +
                    "; a forked child must not map, unmap or close its pages");
  }
}

std::size_t RangeState::checked_index(std::int64_t page) const {
  if (page < 0 || static_cast<std::size_t>(page) >= mapped_.size()) {
    throw_invariant("page index " + std::to_string(page) + " out of range [0, " +
                    std::to_string(mapped_.size()) + ")");
  }
  return static_cast<std::size_t>(page);
}

void RangeState::map_one_locked(std::size_t page) {
  // Each step undoes itself on failure, so a page is either fully mapped or left
  // exactly as it was.
  std::size_t off = page * page_size_;
  backend_->create(off);
  try {
    backend_->map(off);
  } catch (...) {
    try {
      backend_->release(off);
    } catch (...) {
    }
    throw;
  }
  mapped_[page] = 1;
  ++num_mapped_;
}

void RangeState::unmap_one_locked(std::size_t page) {
  std::size_t off = page * page_size_;
  backend_->unmap(off);
  mapped_[page] = 0;
  --num_mapped_;
  backend_->release(off);
}

void RangeState::check_batch_locked(const std::vector<std::int64_t>& pages, bool want_mapped,
                                    const char* op) const {
  std::vector<std::uint8_t> seen(mapped_.size(), 0);
  for (std::int64_t raw : pages) {
    std::size_t p = checked_index(raw);
    if (want_mapped && !mapped_[p]) throw_invariant(page_name(p) + " is not mapped");
    if (!want_mapped && mapped_[p]) throw_invariant(page_name(p) + " is already mapped");
    if (seen[p]) throw_invariant(page_name(p) + " appears twice in one " + op + "() call");
    seen[p] = 1;
  }
}

void RangeState::map(const std::vector<std::int64_t>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  check_batch_locked(pages, /*want_mapped=*/false, "map");
  std::size_t done = 0;
  try {
    for (; done < pages.size(); ++done) map_one_locked(static_cast<std::size_t>(pages[done]));
  } catch (...) {
    // Roll back in reverse so the range ends exactly as it started.
    while (done > 0) {
      --done;
      try {
        unmap_one_locked(static_cast<std::size_t>(pages[done]));
      } catch (...) {
        // Only possible at the OS mapping limit when undoing a page means
        // splitting a merged mapping. The page then stays recorded as mapped
        // (which is the truth, and unmap() can retry it); the original error
        // is what the caller sees.
      }
    }
    coalesce_after_fallbacks_locked(pages, pages.size());
    throw;
  }
}

void RangeState::coalesce_after_fallbacks_locked(const std::vector<std::int64_t>& pages,
                                                 std::size_t count) noexcept {
  // A batch that reached the OS mapping limit is rolled back by unmaps that leave each slot a
  // mapping of its own (CpuBackend::unmap); the range would then hold the process at the limit,
  // and every later map would fail. Every maximal run of unmapped slots between the batch's
  // lowest and highest page goes back as one reservation. Only after a fallback: the normal
  // path never scans. Nothing here allocates: at the limit malloc's own mmap fails too.
  if (!backend_->take_fallbacks() || count == 0) return;
  std::size_t lo = mapped_.size(), hi = 0;
  for (std::size_t i = 0; i < count; ++i) {
    lo = std::min(lo, static_cast<std::size_t>(pages[i]));
    hi = std::max(hi, static_cast<std::size_t>(pages[i]));
  }
  std::size_t p = lo;
  while (p > 0 && !mapped_[p - 1]) --p;  // the first run starts where the slots below are mapped
  while (p <= hi) {
    if (mapped_[p]) {
      ++p;
      continue;
    }
    std::size_t end = p + 1;
    while (end < mapped_.size() && !mapped_[end]) ++end;
    backend_->coalesce(p * page_size_, (end - p) * page_size_);
    p = end;
  }
}

void RangeState::unmap(const std::vector<std::int64_t>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  check_batch_locked(pages, /*want_mapped=*/true, "unmap");
  std::size_t done = 0;
  try {
    for (; done < pages.size(); ++done) unmap_one_locked(static_cast<std::size_t>(pages[done]));
  } catch (...) {
    coalesce_after_fallbacks_locked(pages, done);
    throw;
  }
  coalesce_after_fallbacks_locked(pages, done);
}

bool RangeState::is_mapped(std::int64_t page) {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_[checked_index(page)] != 0;
}

std::vector<std::int64_t> RangeState::mapped_pages() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::int64_t> out;
  out.reserve(num_mapped_);
  for (std::size_t p = 0; p < mapped_.size(); ++p) {
    if (mapped_[p]) out.push_back(static_cast<std::int64_t>(p));
  }
  return out;
}

std::size_t RangeState::num_mapped() {
  std::lock_guard<std::mutex> lock(mu_);
  return num_mapped_;
}

void RangeState::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  check_open();  // a forked child may not close the parent's pages
  closed_ = true;
  // Try every page even if one fails, then report the first failure.
  std::exception_ptr first;
  for (std::size_t p = 0; p < mapped_.size(); ++p) {
    if (!mapped_[p]) continue;
    try {
      unmap_one_locked(p);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

bool RangeState::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

std::size_t RangeState::physical_available() { return backend_->physical_available(); }

std::size_t RangeState::committed_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return backend_->committed_bytes(num_mapped_);
}

std::size_t RangeState::view_length(std::int64_t offset, std::int64_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  auto size = static_cast<std::int64_t>(size_);
  if (offset < 0 || offset > size) {
    throw_config("view offset " + std::to_string(offset) + " outside [0, " + std::to_string(size) + "]");
  }
  if (nbytes == -1) nbytes = size - offset;
  if (nbytes < 0 || nbytes > size - offset) {
    throw_config("view of " + std::to_string(nbytes) + " bytes at offset " + std::to_string(offset) +
                 " exceeds the range size " + std::to_string(size));
  }
  return static_cast<std::size_t>(nbytes);
}

}  // namespace kvcached
