"""Typed errors raised by kvcached.

Every failure kvcached reports is one of these classes. The native extension
(`kvcached._vmm`) raises them too: it imports this module when it loads and
translates its C++ exceptions into these types, so callers never see a bare
`RuntimeError` from the driver layer.

Hierarchy::

    KvcachedError
    ├── ConfigError              bad configuration value (names the variable and range)
    ├── BackendError             a virtual-memory backend call failed
    │   ├── DriverError          the CUDA driver returned an error (``.name`` = CUresult name)
    │   └── PhysicalMemoryExhausted  no physical memory: budget reached, or the device is full
    ├── InjectedFault            a failure made on purpose by ``kvcached.faults`` (subclass of
    │                            PhysicalMemoryExhausted, so callers handle it like the real thing)
    ├── CopyValidationError      a block-copy request was rejected before anything was written
    ├── IntegrationError         an engine seam could not be installed (unsupported version, ...)
    └── InvariantError           kvcached's own bookkeeping is inconsistent (a bug; never swallowed)
"""

from __future__ import annotations


class KvcachedError(Exception):
    """Base class of every error kvcached raises on purpose."""


class ConfigError(KvcachedError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class BackendError(KvcachedError):
    """A virtual-memory backend operation failed."""


class DriverError(BackendError):
    """The CUDA driver returned an error.

    ``name`` carries the driver's symbolic error name (for example
    ``"CUDA_ERROR_INVALID_VALUE"``) and ``code`` its numeric value.
    """

    def __init__(self, message: str, name: str = "", code: int = -1) -> None:
        super().__init__(message)
        self.name = name
        self.code = code


class PhysicalMemoryExhausted(BackendError):
    """No physical page could be created: the budget is reached or the device is full.

    This is the driver's out-of-memory condition. The scheduler-side adapter turns it into
    a scheduling miss; it never escapes into the engine core.
    """


class InjectedFault(PhysicalMemoryExhausted):
    """A failure injected on purpose through ``kvcached.faults``.

    ``site`` names the seam where it fired.
    """

    def __init__(self, message: str, site: str = "") -> None:
        super().__init__(message)
        self.site = site


class CopyValidationError(KvcachedError, ValueError):
    """A block-copy batch was rejected; no byte was written."""


class IntegrationError(KvcachedError, RuntimeError):
    """An engine integration could not be installed or is inconsistent."""


class InvariantError(KvcachedError, AssertionError):
    """kvcached's own bookkeeping broke an invariant. Always a bug; never swallowed."""
