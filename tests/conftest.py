"""Session hooks shared by every test directory."""

from __future__ import annotations

import sys


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    # Under `compute-sanitizer --leak-check full` (the GPU sanitizer probe), torch's
    # process-lifetime caches would be reported as leaks at exit; give them back first.
    # Only a run that initialised CUDA pays for the import.
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        from serving_probes.torch_caches import release_torch_caches

        release_torch_caches()
