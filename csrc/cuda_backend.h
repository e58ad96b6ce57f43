// CUDA backend: cuMemAddressReserve / cuMemCreate / cuMemMap through the
// dlopen'ed driver (cuda_driver.h).
#pragma once

#include <vector>

#include "backend.h"
#include "cuda_driver.h"

namespace kvcached {

// Unmapped slots have no mapping at all. We deliberately do not back them
// with a shared zero page: a stray kernel access then faults loudly
// (illegal address) instead of silently reading zeros or, worse, writing into
// memory another slot aliases.
class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, std::size_t page_size);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::uintptr_t reserve(std::size_t size) override;
  void free_reservation() noexcept override;
  void create(std::size_t offset) override;
  void map(std::size_t offset) override;
  void unmap(std::size_t offset) override;
  void release(std::size_t offset) override;
  std::size_t physical_available() override;
  std::size_t committed_bytes(std::size_t num_mapped) override;
  int dl_device_type() const noexcept override { return 2; }  // kDLCUDA
  int device_id() const noexcept override { return device_; }
  std::string device_string() const override { return "cuda:" + std::to_string(device_); }

 private:
  cuda::CUmemGenericAllocationHandle& handle(std::size_t offset) {
    return handles_[offset / page_size_];
  }

  int device_;
  std::size_t page_size_;
  std::size_t size_ = 0;
  cuda::CUdeviceptr base_ = 0;
  std::vector<cuda::CUmemGenericAllocationHandle> handles_;  // 0 = no physical page
};

}  // namespace kvcached
