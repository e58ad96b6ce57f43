// The one interface every memory backend implements.
//
// A Backend owns one virtual reservation and the physical pages behind its
// slots. It does no bookkeeping of its own: RangeState (vrange.h) validates
// indices, tracks which slots are mapped, charges the Budget and serialises
// calls, so each method here may assume it is called correctly and only has
// to report OS / driver failures (by throwing VmmError).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvcached {

class Backend {
 public:
  virtual ~Backend() = default;

  // Reserves `size` bytes of address space (no physical memory) and returns
  // its base address. Called once, before any other method.
  virtual std::uintptr_t reserve(std::size_t size) = 0;

  // Gives the address space back. Called once, after every page was
  // unmapped and released. Never throws: it runs from destructors.
  virtual void free_reservation() noexcept = 0;

  // Creates the physical memory for the slot starting at byte `offset`.
  virtual void create(std::size_t offset) = 0;
  // Maps the slot's physical memory read/write at base + offset.
  virtual void map(std::size_t offset) = 0;
  // Removes the slot's mapping (the slot becomes inaccessible again).
  virtual void unmap(std::size_t offset) = 0;
  // Returns the slot's physical memory to the OS / device.
  virtual void release(std::size_t offset) = 0;

  // Whether an unmap since the last call had to leave its slot a mapping of its own (CPU: at
  // the OS mapping limit); clears the flag. RangeState then calls `coalesce`.
  virtual bool take_fallbacks() noexcept { return false; }
  // Makes [offset, offset + length), slots none of which is mapped, one inaccessible
  // reservation again, so that the mappings a fallback left go back to the OS. Best effort:
  // the slots are inaccessible either way.
  virtual void coalesce(std::size_t /*offset*/, std::size_t /*length*/) noexcept {}

  // Bytes of physical memory that could still be created right now.
  virtual std::size_t physical_available() = 0;
  // Physical bytes currently held by this range.
  virtual std::size_t committed_bytes(std::size_t num_mapped) = 0;

  // DLPack device type (kDLCPU / kDLCUDA) and ordinal of the memory.
  virtual int dl_device_type() const noexcept = 0;
  virtual int device_id() const noexcept = 0;
  virtual std::string device_string() const = 0;
};

}  // namespace kvcached
