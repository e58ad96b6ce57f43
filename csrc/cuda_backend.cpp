#include "cuda_backend.h"

#include "errors.h"

namespace kvcached {

using cuda::check;
using cuda::ContextGuard;
using cuda::driver;

CudaBackend::CudaBackend(int device, std::size_t page_size)
    : device_(device), page_size_(page_size) {
  cuda::check_device(device);
}

CudaBackend::~CudaBackend() { free_reservation(); }

std::uintptr_t CudaBackend::reserve(std::size_t size) {
  ContextGuard guard(device_);
  cuda::CUdeviceptr ptr = 0;
  check(driver().MemAddressReserve(&ptr, size, cuda::reserve_alignment(page_size_), 0, 0), "cuMemAddressReserve");
  base_ = ptr;
  size_ = size;
  handles_.assign(size / page_size_, 0);
  return static_cast<std::uintptr_t>(ptr);
}

void CudaBackend::free_reservation() noexcept {
  if (base_ == 0) return;
  // Errors are ignored on purpose: this runs from destructors, possibly while
  // the process is exiting and the driver is already shutting down.
  try {
    ContextGuard guard(device_);
    const cuda::Driver& f = driver();
    for (auto& h : handles_) {
      if (h != 0) f.MemRelease(h);
      h = 0;
    }
    f.MemAddressFree(base_, size_);
  } catch (...) {
  }
  base_ = 0;
}

void CudaBackend::create(std::size_t offset) {
  ContextGuard guard(device_);
  cuda::CUmemAllocationProp prop = cuda::pinned_device_prop(device_);
  cuda::CUmemGenericAllocationHandle h = 0;
  check(driver().MemCreate(&h, page_size_, &prop, 0), "cuMemCreate");
  handle(offset) = h;
}

void CudaBackend::map(std::size_t offset) {
  ContextGuard guard(device_);
  const cuda::Driver& f = driver();
  cuda::CUdeviceptr addr = base_ + offset;
  check(f.MemMap(addr, page_size_, 0, handle(offset), 0), "cuMemMap");
  cuda::CUmemAccessDesc access{};
  access.location.type = cuda::CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = cuda::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  cuda::CUresult r = f.MemSetAccess(addr, page_size_, &access, 1);
  if (r != cuda::CUDA_SUCCESS) {
    f.MemUnmap(addr, page_size_);  // undo our half of the work before reporting
    check(r, "cuMemSetAccess");
  }
}

void CudaBackend::unmap(std::size_t offset) {
  ContextGuard guard(device_);
  check(driver().MemUnmap(base_ + offset, page_size_), "cuMemUnmap");
}

void CudaBackend::release(std::size_t offset) {
  ContextGuard guard(device_);
  cuda::CUmemGenericAllocationHandle& h = handle(offset);
  if (h == 0) return;
  check(driver().MemRelease(h), "cuMemRelease");
  h = 0;
}

std::size_t CudaBackend::physical_available() { return cuda::mem_info(device_).first; }

std::size_t CudaBackend::committed_bytes(std::size_t num_mapped) {
  return num_mapped * page_size_;
}

}  // namespace kvcached
