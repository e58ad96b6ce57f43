#include "cuda_floor.h"

#include <chrono>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "errors.h"

namespace kvcached {
namespace cuda {

namespace {

using Clock = std::chrono::steady_clock;

// Runs `call`, adds its duration to `total_ns`, and checks its result.
template <typename Call>
void timed(double& total_ns, const char* what, Call&& call) {
  const auto start = Clock::now();
  const CUresult r = call();
  total_ns += std::chrono::duration<double, std::nano>(Clock::now() - start).count();
  check(r, what);
}

}  // namespace

FloorTimes driver_floor(int device, std::size_t page_size, std::size_t pages) {
  check_device(device);
  if (pages == 0) throw_config("driver_floor: pages must be positive");
  if (page_size == 0 || page_size % granularity(device) != 0) {
    throw_config("driver_floor: page_size " + std::to_string(page_size) +
                 " is not a multiple of the device granularity " +
                 std::to_string(granularity(device)));
  }
  ContextGuard guard(device);
  const Driver& f = driver();
  CUdeviceptr base = 0;
  check(f.MemAddressReserve(&base, pages * page_size, reserve_alignment(page_size), 0, 0), "cuMemAddressReserve");
  const CUmemAllocationProp prop = pinned_device_prop(device);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

  std::vector<CUmemGenericAllocationHandle> handles(pages, 0);
  std::vector<bool> mapped(pages, false);
  FloorTimes t;
  try {
    for (std::size_t i = 0; i < pages; ++i) {
      const CUdeviceptr addr = base + i * page_size;
      timed(t.create_ns, "cuMemCreate", [&] { return f.MemCreate(&handles[i], page_size, &prop, 0); });
      timed(t.map_ns, "cuMemMap", [&] { return f.MemMap(addr, page_size, 0, handles[i], 0); });
      mapped[i] = true;
      timed(t.set_access_ns, "cuMemSetAccess",
            [&] { return f.MemSetAccess(addr, page_size, &access, 1); });
    }
    for (std::size_t i = 0; i < pages; ++i) {
      timed(t.unmap_ns, "cuMemUnmap", [&] { return f.MemUnmap(base + i * page_size, page_size); });
      mapped[i] = false;
      timed(t.release_ns, "cuMemRelease", [&] { return f.MemRelease(handles[i]); });
      handles[i] = 0;
    }
  } catch (...) {
    // Give back whatever the failed pass left behind, then report the failure.
    for (std::size_t i = 0; i < pages; ++i) {
      if (mapped[i]) f.MemUnmap(base + i * page_size, page_size);
      if (handles[i] != 0) f.MemRelease(handles[i]);
    }
    f.MemAddressFree(base, pages * page_size);
    throw;
  }
  check(f.MemAddressFree(base, pages * page_size), "cuMemAddressFree");
  const double n = static_cast<double>(pages);
  t.create_ns /= n;
  t.map_ns /= n;
  t.set_access_ns /= n;
  t.unmap_ns /= n;
  t.release_ns /= n;
  return t;
}

}  // namespace cuda
}  // namespace kvcached
