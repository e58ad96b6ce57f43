"""Conformance harness: native and kvcached vLLM side by side, with exact-parity reports.

``python -m conformance --help`` documents the command line. The package never imports vLLM
in the parent process; every engine runs in its own child process (``conformance.engine``).
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
