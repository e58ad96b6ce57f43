// The DLPack ABI, declared here so the build has no external header dependency.
// Layouts follow the DLPack spec: the v0.x "dltensor" capsule (DLManagedTensor) and
// the 1.0 "dltensor_versioned" capsule (DLManagedTensorVersioned, which carries a
// version and flags; without the read-only flag a consumer such as numpy may write).
#pragma once

#include <cstdint>
#include <memory>

namespace kvcached {

class RangeState;

namespace dl {

constexpr std::int32_t kDLCPU = 1;
constexpr std::int32_t kDLCUDA = 2;
constexpr std::uint8_t kDLUInt = 1;

struct DLDevice {
  std::int32_t device_type;  // DLDeviceType enum (4 bytes)
  std::int32_t device_id;
};

struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // nullptr = compact row-major
  std::uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

struct DLPackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};

struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  std::uint64_t flags;  // bit 0: read-only, bit 1: is a copy (kvcached sets neither)
  DLTensor dl_tensor;
};

static_assert(sizeof(DLDevice) == 8, "DLDevice ABI");
static_assert(sizeof(DLDataType) == 4, "DLDataType ABI");
static_assert(sizeof(DLTensor) == 48, "DLTensor ABI");
static_assert(sizeof(DLManagedTensor) == 64, "DLManagedTensor ABI");
static_assert(sizeof(DLManagedTensorVersioned) == 80, "DLManagedTensorVersioned ABI");

// Builds a 1-D uint8 tensor over [offset, offset + nbytes) of the range. The
// returned tensor owns a shared_ptr to the range (through manager_ctx), so the
// reservation lives until its deleter runs. Bounds are the caller's job.
DLManagedTensor* export_bytes(const std::shared_ptr<RangeState>& range, std::size_t offset,
                              std::size_t nbytes);

// The same view as a DLPack 1.0 tensor (version 1.0, writable, not a copy).
DLManagedTensorVersioned* export_bytes_versioned(const std::shared_ptr<RangeState>& range,
                                                 std::size_t offset, std::size_t nbytes);

}  // namespace dl
}  // namespace kvcached
