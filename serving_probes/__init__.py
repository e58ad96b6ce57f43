"""GPU probes for kvcached: the real CUDA path, measured and checked on a device.

`python -m serving_probes` (or `nox -s gpu-probes`) runs, on a CUDA machine:

* ``copy``: the spec's VMM copy matrix (NHD/HND x separate/interleaved layers x
  logical/kernel block ratio 1/2), 600 blocks each, through kvcached's real CUDA backend;
* ``cost``: per-page map/unmap cost against the raw driver floor, plus batching and the
  pre-mapped reserve;
* ``sanitizer``: kvcached's backend tests and the copy matrix under ``compute-sanitizer
  --tool memcheck --leak-check full``, with controls (a planted leak must be reported);
* ``serving``: the hybrid attention/GDN serving probe (needs a CUDA build of vLLM; skipped
  with the reason otherwise).

Nothing here imports vLLM except the serving probe, lazily.
"""
