// Minimal, header-free binding of the CUDA driver API, loaded with dlopen.
//
// kvcached must build and import on machines without CUDA, so nothing here
// comes from cuda.h: the few types below are declared by hand with the
// driver's ABI (sizes are checked with static_assert), and the functions are
// resolved from libcuda.so.1 at run time.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

namespace kvcached {
namespace cuda {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUdeviceptr = unsigned long long;
using CUmemGenericAllocationHandle = unsigned long long;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;

constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 1;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0;

// The enum-typed members of the driver structs are plain 4-byte ints in the ABI.
struct CUmemLocation {
  int type;  // CUmemLocationType
  int id;
};

struct CUmemAllocationProp {
  int type;                  // CUmemAllocationType
  int requestedHandleTypes;  // CUmemAllocationHandleType (0 = none)
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};

struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CUmemAccess_flags
};

static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation ABI");
static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp ABI");
static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc ABI");

// Function table filled by dlsym. Names in comments are the exported symbols.
struct Driver {
  CUresult (*Init)(unsigned int);                                    // cuInit
  CUresult (*DeviceGet)(CUdevice*, int);                             // cuDeviceGet
  CUresult (*DeviceGetCount)(int*);                                  // cuDeviceGetCount
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);          // cuDevicePrimaryCtxRetain
  CUresult (*CtxGetCurrent)(CUcontext*);                             // cuCtxGetCurrent
  CUresult (*CtxSetCurrent)(CUcontext);                              // cuCtxSetCurrent
  CUresult (*CtxGetDevice)(CUdevice*);                               // cuCtxGetDevice
  CUresult (*MemAddressReserve)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr,
                                unsigned long long);                 // cuMemAddressReserve
  CUresult (*MemAddressFree)(CUdeviceptr, std::size_t);              // cuMemAddressFree
  CUresult (*MemCreate)(CUmemGenericAllocationHandle*, std::size_t, const CUmemAllocationProp*,
                        unsigned long long);                         // cuMemCreate
  CUresult (*MemMap)(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle,
                     unsigned long long);                            // cuMemMap
  CUresult (*MemSetAccess)(CUdeviceptr, std::size_t, const CUmemAccessDesc*,
                           std::size_t);                             // cuMemSetAccess
  CUresult (*MemUnmap)(CUdeviceptr, std::size_t);                    // cuMemUnmap
  CUresult (*MemRelease)(CUmemGenericAllocationHandle);              // cuMemRelease
  CUresult (*MemGetAllocationGranularity)(std::size_t*, const CUmemAllocationProp*,
                                          int);                      // cuMemGetAllocationGranularity
  CUresult (*MemGetInfo)(std::size_t*, std::size_t*);                // cuMemGetInfo_v2
  CUresult (*GetErrorName)(CUresult, const char**);                  // cuGetErrorName
  CUresult (*DeviceGetUuid)(unsigned char (*)[16], CUdevice);        // cuDeviceGetUuid_v2
};

// True when libcuda.so.1 loads, cuInit succeeds and at least one device exists.
bool available() noexcept;

// The loaded, initialised driver; throws BackendError/DriverError otherwise.
const Driver& driver();

// Throws for a non-success result: CUDA_ERROR_OUT_OF_MEMORY becomes
// PhysicalMemoryExhausted, anything else DriverError(name, code).
void check(CUresult r, const char* what);

// Validates a device ordinal against cuDeviceGetCount (ConfigError if bad).
void check_device(int device);

// Makes `device`'s primary context current on this thread for the guard's
// lifetime when the current context is missing or belongs to another device
// (VMM calls need a context; torch also works in the primary context). A
// context that was current before is restored; "none" is not restored, which
// matches what the CUDA runtime itself does on first use.
class ContextGuard {
 public:
  explicit ContextGuard(int device);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  CUcontext restore_ = nullptr;
};

std::pair<std::size_t, std::size_t> mem_info(int device);  // (free, total)
std::size_t granularity(int device);

// The alignment to reserve a range of `page_size` pages with: the largest power of two
// dividing the page. cuMemAddressReserve takes only a power of two (a 6 MiB page, three
// 2 MiB granules, failed with CUDA_ERROR_INVALID_VALUE on the H200); a page is a multiple
// of the granularity, itself a power of two, so this is at least the granularity and every
// page offset of the range stays granularity-aligned.
constexpr std::size_t reserve_alignment(std::size_t page_size) { return page_size & (~page_size + 1); }
static_assert(reserve_alignment(std::size_t{6} << 20) == std::size_t{2} << 20, "6 MiB pages: 2 MiB aligned");
static_assert(reserve_alignment(std::size_t{4} << 20) == std::size_t{4} << 20, "4 MiB pages: 4 MiB aligned");

// The device's UUID as nvidia-smi prints it ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"):
// the same in every process whatever CUDA_VISIBLE_DEVICES renumbers.
std::string device_uuid(int device);
CUmemAllocationProp pinned_device_prop(int device);

}  // namespace cuda
}  // namespace kvcached
