// Python bindings for kvcached._vmm (API fixed by docs/contracts.md).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <exception>

#include "cpu_backend.h"
#include "cuda_driver.h"
#include "cuda_floor.h"
#include "dlpack.h"
#include "errors.h"
#include "vrange.h"

namespace py = pybind11;
using kvcached::RangeState;
using kvcached::VmmError;

namespace {

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kVersionedCapsuleName = "dltensor_versioned";

// The kvcached.errors classes, resolved once at import. Deliberately leaked:
// decref'ing them from a static destructor after the interpreter is gone
// would crash at exit.
struct ErrorClasses {
  py::object config, invariant, exhausted, driver, backend;
};
ErrorClasses* g_errors = nullptr;

void set_python_error(const VmmError& e) {
  const ErrorClasses& c = *g_errors;
  switch (e.kind()) {
    case VmmError::Kind::Config:
      PyErr_SetString(c.config.ptr(), e.what());
      return;
    case VmmError::Kind::Invariant:
      PyErr_SetString(c.invariant.ptr(), e.what());
      return;
    case VmmError::Kind::Exhausted:
      PyErr_SetString(c.exhausted.ptr(), e.what());
      return;
    case VmmError::Kind::Driver: {
      // DriverError carries .name/.code, so build the instance explicitly.
      PyObject* exc = PyObject_CallFunction(c.driver.ptr(), "ssi", e.what(), e.driver_name().c_str(),
                                            e.code());
      if (exc == nullptr) return;  // the constructor's own error is left set
      PyErr_SetObject(c.driver.ptr(), exc);
      Py_DECREF(exc);
      return;
    }
    case VmmError::Kind::Backend:
      PyErr_SetString(c.backend.ptr(), e.what());
      return;
  }
  PyErr_SetString(c.backend.ptr(), e.what());
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const VmmError& e) {
    set_python_error(e);
  }
}

// Capsule destructors: a consumer that takes ownership renames the capsule to
// "used_dltensor" ("used_dltensor_versioned") and becomes responsible for calling the
// deleter; only an unconsumed capsule still owns its tensor.
void capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kCapsuleName)) return;
  auto* t = static_cast<kvcached::dl::DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (t != nullptr && t->deleter != nullptr) t->deleter(t);
}

void versioned_capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kVersionedCapsuleName)) return;
  auto* t = static_cast<kvcached::dl::DLManagedTensorVersioned*>(
      PyCapsule_GetPointer(capsule, kVersionedCapsuleName));
  if (t != nullptr && t->deleter != nullptr) t->deleter(t);
}

template <typename Managed>
py::object wrap_capsule(Managed* t, const char* name, PyCapsule_Destructor destructor) {
  PyObject* capsule = PyCapsule_New(t, name, destructor);
  if (capsule == nullptr) {
    t->deleter(t);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

py::object make_capsule(const std::shared_ptr<RangeState>& self, std::int64_t offset, std::int64_t nbytes,
                        bool versioned) {
  std::size_t n = self->view_length(offset, nbytes);
  auto off = static_cast<std::size_t>(offset);
  if (versioned) {
    return wrap_capsule(kvcached::dl::export_bytes_versioned(self, off, n), kVersionedCapsuleName,
                        versioned_capsule_destructor);
  }
  return wrap_capsule(kvcached::dl::export_bytes(self, off, n), kCapsuleName, capsule_destructor);
}

// The native ranges of map_each's and unmap_each's batches that run together with the GIL
// released, each with its pages.
using NativeRun = std::vector<std::pair<std::shared_ptr<RangeState>, std::vector<std::int64_t>>>;

// One (backing, pages) pair of `fn`'s batches, checked.
py::tuple batch_pair(py::handle item, const char* fn) {
  py::tuple pair = py::reinterpret_borrow<py::object>(item).cast<py::tuple>();
  if (pair.size() != 2) throw py::value_error(std::string(fn) + ": each batch is a (backing, pages) pair");
  return pair;
}

// Adds the pair to `run` if its backing is a native range; false for any other backing.
bool add_native(NativeRun& run, const py::tuple& pair) {
  if (!py::isinstance<RangeState>(pair[0])) return false;
  run.emplace_back(pair[0].cast<std::shared_ptr<RangeState>>(), pair[1].cast<std::vector<std::int64_t>>());
  return true;
}

// kvcached._vmm.map_each: each (backing, pages) of `batches` mapped in turn, and `done` given
// an entry for every backing that mapped its whole list, so that the caller knows after a
// failure which ones to undo (kvcached.pages.PageSpace.map_pages; the first failure is
// raised). A run of native ranges maps with the GIL released once for the whole run, not
// once per range: a thread of the same process running Python meanwhile costs a GIL
// handoff at each retake, up to the switch interval (5 ms) each. Any other backing (a fault
// seam's wrapper, kvcached.faults.FailingRange) is called through its own `map` in its turn.
void map_each(const py::sequence& batches, py::list done) {
  NativeRun run;
  auto map_run = [&]() {
    std::size_t mapped = 0;
    std::exception_ptr failed;
    {
      py::gil_scoped_release nogil;
      try {
        for (auto& [range, pages] : run) {
          range->map(pages);
          ++mapped;
        }
      } catch (...) {
        failed = std::current_exception();
      }
    }
    for (std::size_t i = 0; i < mapped; ++i) done.append(py::none());
    run.clear();
    if (failed) std::rethrow_exception(failed);
  };
  for (py::handle item : batches) {
    py::tuple pair = batch_pair(item, "map_each");
    if (add_native(run, pair)) continue;
    map_run();
    pair[0].attr("map")(pair[1]);
    done.append(py::none());
  }
  map_run();
}

// kvcached._vmm.unmap_each: each (backing, pages) of `batches` unmapped, every backing tried
// even after one fails; the first failure is raised after the last (kvcached.pages.
// PageSpace._unmap_each). Native ranges as in map_each, a run of them with the GIL released
// once; any other backing through its own `unmap`, where only an Exception is kept for later.
void unmap_each(const py::sequence& batches) {
  std::exception_ptr first;
  NativeRun run;
  auto unmap_run = [&]() {
    {
      py::gil_scoped_release nogil;
      for (auto& [range, pages] : run) {
        try {
          range->unmap(pages);
        } catch (...) {
          if (!first) first = std::current_exception();
        }
      }
    }
    run.clear();
  };
  for (py::handle item : batches) {
    py::tuple pair = batch_pair(item, "unmap_each");
    if (add_native(run, pair)) continue;
    unmap_run();
    try {
      pair[0].attr("unmap")(pair[1]);
    } catch (py::error_already_set& e) {
      if (!e.matches(PyExc_Exception)) throw;  // KeyboardInterrupt and the like: at once
      if (!first) first = std::current_exception();
    }
  }
  unmap_run();
  if (first) std::rethrow_exception(first);
}

std::string range_repr(RangeState& r) {
  return "VirtualRange(device='" + r.device() + "', size=" + std::to_string(r.size()) +
         ", page_size=" + std::to_string(r.page_size()) + ", mapped=" + std::to_string(r.num_mapped()) +
         "/" + std::to_string(r.num_pages()) + (r.closed() ? ", closed" : "") + ")";
}

}  // namespace

PYBIND11_MODULE(_vmm, m) {
  m.doc() = "kvcached native layer: virtual ranges with on-demand physical pages (CPU and CUDA).";

  py::module_ errors = py::module_::import("kvcached.errors");
  g_errors = new ErrorClasses{errors.attr("ConfigError"), errors.attr("InvariantError"),
                              errors.attr("PhysicalMemoryExhausted"), errors.attr("DriverError"),
                              errors.attr("BackendError")};
  py::register_exception_translator(&translate);

  using release_gil = py::call_guard<py::gil_scoped_release>;

  py::class_<RangeState, std::shared_ptr<RangeState>>(m, "VirtualRange",
                                                      "A reserved address range whose pages are "
                                                      "mapped to physical memory on demand.")
      .def(py::init([](const std::string& device, std::int64_t size, std::int64_t page_size) {
             return std::make_shared<RangeState>(device, size, page_size);
           }),
           py::arg("device"), py::arg("size"), py::arg("page_size"), release_gil())
      .def_property_readonly("device", &RangeState::device)
      .def_property_readonly("address", &RangeState::address)
      .def_property_readonly("size", &RangeState::size)
      .def_property_readonly("page_size", &RangeState::page_size)
      .def_property_readonly("num_pages", &RangeState::num_pages)
      .def_property_readonly("num_mapped", &RangeState::num_mapped)
      .def_property_readonly("closed", &RangeState::closed)
      .def_property_readonly("live_views",
                             [](const RangeState& r) { return r.live_views.load(); },
                             "DLPack views of this range still alive (capsules and tensors).")
      .def("map", &RangeState::map, py::arg("pages"), release_gil(),
           "Back the pages with physical memory. All-or-nothing: on any error nothing stays mapped.")
      .def("unmap", &RangeState::unmap, py::arg("pages"), release_gil(),
           "Validate every page, then unmap them and give their memory back.")
      .def("is_mapped", &RangeState::is_mapped, py::arg("page"))
      .def("mapped_pages", &RangeState::mapped_pages)
      .def("dlpack", &make_capsule, py::arg("offset") = 0, py::arg("nbytes") = -1, py::arg("versioned") = false,
           "A 'dltensor' capsule (versioned: a DLPack 1.0 'dltensor_versioned' one, writable): 1-D uint8 "
           "view of [offset, offset+nbytes); keeps the VA reserved.")
      .def("close", &RangeState::close, release_gil(),
           "Unmap everything (idempotent). The VA is freed once the last view is gone.")
      .def("physical_available", &RangeState::physical_available, release_gil(),
           "Bytes the device could still map: MemAvailable (cpu) / device free (cuda); budgets are above.")
      .def("committed_bytes", &RangeState::committed_bytes, release_gil(),
           "Physical bytes held now: memfd blocks (cpu) / mapped pages x page size (cuda).")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](RangeState& r, const py::args&) {
             py::gil_scoped_release nogil;
             r.close();
           })
      .def("__repr__", &range_repr);

  m.def("cuda_available", &kvcached::cuda::available, release_gil(),
        "True when libcuda.so.1 loads, cuInit succeeds and a device exists.");
  m.def("cuda_mem_info", &kvcached::cuda::mem_info, py::arg("device"), release_gil(),
        "(free, total) bytes of a CUDA device, from cuMemGetInfo_v2.");
  m.def("cuda_device_uuid", &kvcached::cuda::device_uuid, py::arg("device"), release_gil(),
        "The device's UUID (\"GPU-...\"), stable across processes and CUDA_VISIBLE_DEVICES.");
  m.def("cuda_granularity", &kvcached::cuda::granularity, py::arg("device"), release_gil(),
        "Minimum VMM allocation granularity of a CUDA device in bytes.");
  m.def(
      "cuda_driver_floor",
      [](int device, std::size_t page_size, std::size_t pages) {
        kvcached::cuda::FloorTimes t;
        {
          py::gil_scoped_release nogil;
          t = kvcached::cuda::driver_floor(device, page_size, pages);
        }
        py::dict d;
        d["create_us"] = t.create_ns / 1000.0;
        d["map_us"] = t.map_ns / 1000.0;
        d["set_access_us"] = t.set_access_ns / 1000.0;
        d["unmap_us"] = t.unmap_ns / 1000.0;
        d["release_us"] = t.release_ns / 1000.0;
        return d;
      },
      py::arg("device"), py::arg("page_size"), py::arg("pages"),
      "Mean microseconds per raw driver call (create, map, set_access, unmap, release) over "
      "`pages` pages mapped and unmapped one at a time, timed natively with no kvcached "
      "bookkeeping: the floor the GPU cost probe compares kvcached against.");
  m.def("map_each", &map_each, py::arg("batches"), py::arg("done"),
        "Map each (backing, pages) pair in turn, a run of native ranges with the GIL released once; "
        "`done` gets an entry for every backing that mapped its whole list. The first failure is raised.");
  m.def("unmap_each", &unmap_each, py::arg("batches"),
        "Unmap each (backing, pages) pair, every one tried even after one fails, a run of native ranges "
        "with the GIL released once. The first failure is raised after the last.");
  m.def("os_page_size", &kvcached::os_page_size, "The OS page size in bytes.");
}
