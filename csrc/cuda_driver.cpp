#include "cuda_driver.h"

#include <dlfcn.h>

#include <map>
#include <mutex>

#include "errors.h"

namespace kvcached {
namespace cuda {

namespace {

struct Loaded {
  Driver fn{};
  bool ok = false;
  std::string why;     // reason when !ok
  CUresult init_rc = CUDA_SUCCESS;
};

template <typename F>
bool resolve(void* lib, const char* name, F& slot, std::string& why) {
  void* sym = dlsym(lib, name);
  if (sym == nullptr) {
    why = std::string("libcuda.so.1 has no symbol ") + name;
    return false;
  }
  slot = reinterpret_cast<F>(sym);
  return true;
}

Loaded load() {
  Loaded d;
  // The handle is never dlclose'd: the driver must outlive every range,
  // including ranges torn down during interpreter exit.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    d.why = std::string("cannot load libcuda.so.1: ") + (err ? err : "unknown error");
    return d;
  }
  Driver& f = d.fn;
  bool ok = resolve(lib, "cuInit", f.Init, d.why) && resolve(lib, "cuDeviceGet", f.DeviceGet, d.why) &&
            resolve(lib, "cuDeviceGetCount", f.DeviceGetCount, d.why) &&
            resolve(lib, "cuDevicePrimaryCtxRetain", f.DevicePrimaryCtxRetain, d.why) &&
            resolve(lib, "cuCtxGetCurrent", f.CtxGetCurrent, d.why) &&
            resolve(lib, "cuCtxSetCurrent", f.CtxSetCurrent, d.why) &&
            resolve(lib, "cuCtxGetDevice", f.CtxGetDevice, d.why) &&
            resolve(lib, "cuMemAddressReserve", f.MemAddressReserve, d.why) &&
            resolve(lib, "cuMemAddressFree", f.MemAddressFree, d.why) &&
            resolve(lib, "cuMemCreate", f.MemCreate, d.why) &&
            resolve(lib, "cuMemMap", f.MemMap, d.why) &&
            resolve(lib, "cuMemSetAccess", f.MemSetAccess, d.why) &&
            resolve(lib, "cuMemUnmap", f.MemUnmap, d.why) &&
            resolve(lib, "cuMemRelease", f.MemRelease, d.why) &&
            resolve(lib, "cuMemGetAllocationGranularity", f.MemGetAllocationGranularity, d.why) &&
            resolve(lib, "cuMemGetInfo_v2", f.MemGetInfo, d.why) &&
            resolve(lib, "cuGetErrorName", f.GetErrorName, d.why) &&
            resolve(lib, "cuDeviceGetUuid_v2", f.DeviceGetUuid, d.why);
  if (!ok) return d;
  d.init_rc = f.Init(0);
  if (d.init_rc != CUDA_SUCCESS) {
    d.why = "cuInit failed";
    return d;
  }
  d.ok = true;
  return d;
}

const Loaded& loaded() {
  static const Loaded d = load();  // thread-safe one-time initialisation
  return d;
}

std::string error_name(const Driver& f, CUresult r) {
  const char* name = nullptr;
  if (f.GetErrorName != nullptr && f.GetErrorName(r, &name) == CUDA_SUCCESS && name != nullptr) {
    return name;
  }
  return "CUDA_ERROR_" + std::to_string(r);
}

// Primary contexts are retained once per device and never released: torch
// holds its own reference, and releasing during interpreter exit could race
// the driver's own teardown for no benefit.
CUcontext primary_context(int device) {
  static std::mutex mu;
  static std::map<int, CUcontext>* ctxs = new std::map<int, CUcontext>();  // leaked on purpose
  std::lock_guard<std::mutex> lock(mu);
  auto it = ctxs->find(device);
  if (it != ctxs->end()) return it->second;
  const Driver& f = driver();
  CUdevice dev = 0;
  check(f.DeviceGet(&dev, device), "cuDeviceGet");
  CUcontext ctx = nullptr;
  check(f.DevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  (*ctxs)[device] = ctx;
  return ctx;
}

}  // namespace

bool available() noexcept {
  const Loaded& d = loaded();
  if (!d.ok) return false;
  int count = 0;
  return d.fn.DeviceGetCount(&count) == CUDA_SUCCESS && count > 0;
}

const Driver& driver() {
  const Loaded& d = loaded();
  if (d.ok) return d.fn;
  if (d.init_rc != CUDA_SUCCESS) {
    std::string name = error_name(d.fn, d.init_rc);
    if (d.init_rc == CUDA_ERROR_OUT_OF_MEMORY) throw_exhausted("cuInit: " + name);
    throw VmmError(VmmError::Kind::Driver, "cuInit: " + name, name, d.init_rc);
  }
  throw VmmError(VmmError::Kind::Backend, d.why);
}

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  std::string name = error_name(loaded().fn, r);
  std::string msg = std::string(what) + " failed: " + name + " (" + std::to_string(r) + ")";
  if (r == CUDA_ERROR_OUT_OF_MEMORY) throw_exhausted(msg);
  throw VmmError(VmmError::Kind::Driver, msg, name, r);
}

void check_device(int device) {
  int count = 0;
  check(driver().DeviceGetCount(&count), "cuDeviceGetCount");
  if (device < 0 || device >= count) {
    throw_config("CUDA device " + std::to_string(device) + " out of range (" +
                 std::to_string(count) + " devices)");
  }
}

ContextGuard::ContextGuard(int device) {
  const Driver& f = driver();
  CUcontext cur = nullptr;
  check(f.CtxGetCurrent(&cur), "cuCtxGetCurrent");
  if (cur != nullptr) {
    CUdevice cur_dev = -1;
    check(f.CtxGetDevice(&cur_dev), "cuCtxGetDevice");
    if (cur_dev == device) return;  // already in a context of our device
  }
  check(f.CtxSetCurrent(primary_context(device)), "cuCtxSetCurrent");
  restore_ = cur;
}

ContextGuard::~ContextGuard() {
  if (restore_ != nullptr) loaded().fn.CtxSetCurrent(restore_);  // best effort, never throws
}

CUmemAllocationProp pinned_device_prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

std::pair<std::size_t, std::size_t> mem_info(int device) {
  check_device(device);
  ContextGuard guard(device);
  std::size_t free_b = 0, total_b = 0;
  check(driver().MemGetInfo(&free_b, &total_b), "cuMemGetInfo_v2");
  return {free_b, total_b};
}

std::size_t granularity(int device) {
  check_device(device);
  CUmemAllocationProp prop = pinned_device_prop(device);
  std::size_t g = 0;
  check(driver().MemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  return g;
}

std::string device_uuid(int device) {
  check_device(device);
  CUdevice dev = 0;
  check(driver().DeviceGet(&dev, device), "cuDeviceGet");
  unsigned char id[16] = {};
  check(driver().DeviceGetUuid(&id, dev), "cuDeviceGetUuid_v2");
  static const char* hex = "0123456789abcdef";
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += hex[id[i] >> 4];
    out += hex[id[i] & 15];
  }
  return out;
}

}  // namespace cuda
}  // namespace kvcached
