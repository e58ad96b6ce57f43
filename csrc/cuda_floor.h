// The raw driver floor of one VMM page: what cuMemCreate + cuMemMap +
// cuMemSetAccess (map) and cuMemUnmap + cuMemRelease (unmap) cost with no
// bookkeeping and no language boundary around them. The GPU cost probe
// compares kvcached's own map/unmap against these figures in the same run.
#pragma once

#include <cstddef>

namespace kvcached {
namespace cuda {

// Mean nanoseconds per call over `pages` pages of `page_size` bytes.
struct FloorTimes {
  double create_ns = 0, map_ns = 0, set_access_ns = 0, unmap_ns = 0, release_ns = 0;
};

// Reserves `pages * page_size` bytes of VA, maps and then unmaps every page
// one at a time, timing each driver call, and frees everything it made, also
// when a call fails (the failure is then thrown as a VmmError).
FloorTimes driver_floor(int device, std::size_t page_size, std::size_t pages);

}  // namespace cuda
}  // namespace kvcached
