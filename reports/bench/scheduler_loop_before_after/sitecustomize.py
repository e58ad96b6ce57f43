# Side-by-side benchmarks of an older tree: drop the editable installs' redirecting finders,
# so that PYTHONPATH's kvcached and conformance are the ones imported.
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable_skbc_")]
