// C++ side of kvcached's error model.
//
// Native code throws VmmError only; module.cpp translates each Kind into the
// matching class of kvcached/errors.py, so Python never sees a bare RuntimeError.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvcached {

class VmmError : public std::runtime_error {
 public:
  enum class Kind {
    Config,     // bad argument                      -> ConfigError
    Invariant,  // double map, bad index, closed use  -> InvariantError
    Exhausted,  // budget reached / device OOM        -> PhysicalMemoryExhausted
    Driver,     // other CUDA driver errors            -> DriverError(name, code)
    Backend,    // OS call failed                      -> BackendError
  };

  VmmError(Kind kind, const std::string& msg, std::string driver_name = "",
           int code = -1)
      : std::runtime_error(msg), kind_(kind), driver_name_(std::move(driver_name)),
        code_(code) {}

  Kind kind() const noexcept { return kind_; }
  const std::string& driver_name() const noexcept { return driver_name_; }
  int code() const noexcept { return code_; }

 private:
  Kind kind_;
  std::string driver_name_;
  int code_;
};

[[noreturn]] inline void throw_config(const std::string& msg) {
  throw VmmError(VmmError::Kind::Config, msg);
}

[[noreturn]] inline void throw_invariant(const std::string& msg) {
  throw VmmError(VmmError::Kind::Invariant, msg);
}

[[noreturn]] inline void throw_exhausted(const std::string& msg) {
  throw VmmError(VmmError::Kind::Exhausted, msg);
}

// Throws BackendError for a failed syscall; `err` is the saved errno value
// (ENOMEM/ENOSPC are reported as PhysicalMemoryExhausted: the OS ran out).
[[noreturn]] inline void throw_os(const std::string& what, int err) {
  std::string msg = what + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
  if (err == ENOMEM || err == ENOSPC) {
    throw VmmError(VmmError::Kind::Exhausted, msg);
  }
  throw VmmError(VmmError::Kind::Backend, msg);
}

}  // namespace kvcached
