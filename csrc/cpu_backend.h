// CPU backend: host memory with the same reserve/map/unmap shape as CUDA VMM.
#pragma once

#include "backend.h"

namespace kvcached {

std::size_t os_page_size() noexcept;

// Address space comes from an anonymous PROT_NONE reservation; physical pages
// are page-sized slots of one sparse memfd per range (slot i lives at file
// offset i * page_size), so mapping a page is an mmap(MAP_FIXED) of that slot
// and releasing it punches a hole in the file.
class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(std::size_t page_size);
  ~CpuBackend() override;
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  std::uintptr_t reserve(std::size_t size) override;
  void free_reservation() noexcept override;
  void create(std::size_t offset) override;
  void map(std::size_t offset) override;
  void unmap(std::size_t offset) override;
  void release(std::size_t offset) override;
  bool take_fallbacks() noexcept override;
  void coalesce(std::size_t offset, std::size_t length) noexcept override;
  std::size_t physical_available() override;
  std::size_t committed_bytes(std::size_t num_mapped) override;
  int dl_device_type() const noexcept override { return 1; }  // kDLCPU
  int device_id() const noexcept override { return 0; }
  std::string device_string() const override { return "cpu"; }

 private:
  std::size_t page_size_;
  std::size_t size_ = 0;
  char* base_ = nullptr;
  int fd_ = -1;
  bool fell_back_ = false;  // an unmap revoked access in place (see `unmap`)
  char* token_ = nullptr;   // the page after the range, a mapping `coalesce` can give up
};

}  // namespace kvcached
