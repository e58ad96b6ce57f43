#include "cpu_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "errors.h"

namespace kvcached {

namespace {
constexpr std::size_t kHugeAlign = std::size_t{2} << 20;
}  // namespace

std::size_t os_page_size() noexcept {
  long ps = sysconf(_SC_PAGESIZE);
  return ps > 0 ? static_cast<std::size_t>(ps) : 4096;
}

CpuBackend::CpuBackend(std::size_t page_size) : page_size_(page_size) {}

CpuBackend::~CpuBackend() { free_reservation(); }

std::uintptr_t CpuBackend::reserve(std::size_t size) {
  // MAP_NORESERVE + PROT_NONE: address space only, no commit charge, and any
  // access before a page is mapped is a SIGSEGV.
  //
  // Slots are aligned to min(page_size, 2 MiB), like a GPU reservation is
  // aligned to its granularity; it also lets the kernel back a slot with a
  // huge shmem folio where shmem THP is enabled. Over-reserve, then trim.
  const std::size_t align = page_size_ < kHugeAlign ? page_size_ : kHugeAlign;
  const std::size_t slack = align > os_page_size() ? align : 0;
  const std::size_t token = os_page_size();  // see `coalesce`
  void* raw = mmap(nullptr, size + token + slack, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) throw_os("mmap(reserve " + std::to_string(size) + " bytes)", errno);
  auto start = reinterpret_cast<std::uintptr_t>(raw);
  std::uintptr_t aligned = slack ? (start + align - 1) / align * align : start;
  const std::uintptr_t end = start + size + token + slack;
  if (aligned > start) munmap(raw, aligned - start);
  if (end > aligned + size + token) {
    munmap(reinterpret_cast<void*>(aligned + size + token), end - (aligned + size + token));
  }
  // The page after the range: readable, so never merged with the reservation, it is a mapping
  // of its own that `coalesce` can give up.
  token_ = reinterpret_cast<char*>(aligned + size);
  if (mprotect(token_, token, PROT_READ) != 0) {
    munmap(token_, token);
    token_ = nullptr;
  }
  void* p = reinterpret_cast<void*>(aligned);
  int fd = memfd_create("kvcached", MFD_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    munmap(p, size);
    throw_os("memfd_create", err);
  }
  // Sizing the file allocates nothing: slots get memory only when touched.
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    munmap(p, size);
    throw_os("ftruncate(memfd)", err);
  }
  base_ = static_cast<char*>(p);
  size_ = size;
  fd_ = fd;
  return reinterpret_cast<std::uintptr_t>(p);
}

void CpuBackend::free_reservation() noexcept {
  if (base_ != nullptr) {
    munmap(base_, size_);
    base_ = nullptr;
  }
  if (token_ != nullptr) {
    munmap(token_, os_page_size());
    token_ = nullptr;
  }
  if (fd_ >= 0) {
    close(fd_);
    fd_ = -1;
  }
}

void CpuBackend::create(std::size_t /*offset*/) {
  // Nothing to do: the memfd slot already exists (sparse) and the kernel
  // allocates its pages on first touch. The Budget has already been charged.
}

void CpuBackend::map(std::size_t offset) {
  void* want = base_ + offset;
  void* got = mmap(want, page_size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
                   static_cast<off_t>(offset));
  if (got == MAP_FAILED) throw_os("mmap(map slot)", errno);
}

void CpuBackend::unmap(std::size_t offset) {
  // Replace the slot by a fresh PROT_NONE anonymous mapping rather than
  // munmap(): the hole must stay reserved so nobody else gets this address.
  void* want = base_ + offset;
  void* got = mmap(want, page_size_, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (got != MAP_FAILED) return;
  int err = errno;
  // At the vm.max_map_count limit the kernel cannot build the replacement
  // mapping (it briefly needs one more VMA). This is exactly when map()'s
  // rollback runs, so fall back to revoking access on the slot's existing
  // mapping: no new VMA is needed when the slot is a VMA of its own, any
  // access still faults, and release() still punches the memory out.
  if (err == ENOMEM && mprotect(want, page_size_, PROT_NONE) == 0) {
    // The slot stays a mapping of its own: at the limit, every later map that splits the
    // reservation would fail, so RangeState gives the run back in one piece (`coalesce`).
    fell_back_ = true;
    return;
  }
  throw_os("mmap(unmap slot)", err);
}

bool CpuBackend::take_fallbacks() noexcept {
  bool fell_back = fell_back_;
  fell_back_ = false;
  return fell_back;
}

void CpuBackend::coalesce(std::size_t offset, std::size_t length) noexcept {
  // One mapping replaces every mapping of the run, which starts and ends at mapping
  // boundaries (a mapped slot, or the range's ends): no split. But a map refused at the limit
  // can leave the process one mapping above it, where the OS refuses any mmap; giving up the
  // token page first brings it back to the limit (measured: 65,531 mappings, every mmap
  // refused; then one mapping for the run). The token is outside the range, so taking it back
  // (NOREPLACE) may find the address used by someone else: then the range has none.
  const std::size_t token = os_page_size();
  if (token_ != nullptr) {
    munmap(token_, token);
  }
  (void)mmap(base_ + offset, length, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (token_ != nullptr) {
    void* got = mmap(token_, token, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (got != token_) {
      if (got != MAP_FAILED) munmap(got, token);  // a kernel without NOREPLACE placed it elsewhere
      token_ = nullptr;
    }
  }
}

void CpuBackend::release(std::size_t offset) {
  // Punching the hole frees the slot's pages in the memfd; without it the
  // memory would stay charged to the file even though nothing maps it.
  if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                static_cast<off_t>(page_size_)) != 0) {
    throw_os("fallocate(PUNCH_HOLE)", errno);
  }
}

std::size_t CpuBackend::physical_available() {
  // MemAvailable is the kernel's own estimate of what can be allocated
  // without swapping; it is the best unbudgeted analogue of cuMemGetInfo.
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) throw_os("open /proc/meminfo", errno);
  char line[256];
  unsigned long long kib = 0;
  bool found = false;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) {
      found = true;
      break;
    }
  }
  std::fclose(f);
  if (!found) throw VmmError(VmmError::Kind::Backend, "MemAvailable missing from /proc/meminfo");
  return static_cast<std::size_t>(kib) * 1024;
}

std::size_t CpuBackend::committed_bytes(std::size_t /*num_mapped*/) {
  struct stat st;
  if (fstat(fd_, &st) != 0) throw_os("fstat(memfd)", errno);
  return static_cast<std::size_t>(st.st_blocks) * 512;
}

}  // namespace kvcached
