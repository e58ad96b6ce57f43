"""Give back what torch caches for the life of a process, before a leak check looks.

torch keeps some CUDA allocations on purpose until the process dies: freed device
blocks (the caching allocator), pinned host staging used by ``.item()``/``.cpu()``
syncs (the caching host allocator, ``cudaHostAlloc``) and cuBLAS workspaces. A leak
checker that runs at exit reports all of them, which buries any leak of kvcached's in
torch's deliberate caching. Releasing them first leaves only memory somebody still
holds, and the sanitizer probe's planted-leak control shows a held tensor is still
reported after this runs.
"""

from __future__ import annotations

import gc
import sys


def release_torch_caches() -> list[str]:
    """Release torch's process-lifetime CUDA caches; return the steps that ran.

    Does nothing (returns ``[]``) when torch was never imported or never touched CUDA,
    so it is safe to call from any exit path.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return []
    gc.collect()  # tensors only a reference cycle still holds
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    steps = ["synchronize", "empty_cache"]
    # The pinned host cache has had several names across torch releases.
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            steps.append(name)
            break
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
        steps.append("_cuda_clearCublasWorkspaces")
    return steps
