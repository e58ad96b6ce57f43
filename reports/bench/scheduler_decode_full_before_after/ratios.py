"""Pooled decode-step ratios of the wall-clock runs: python3 ratios.py DIR (DIR/old-N/*.json and
DIR/new-N/*.json as run.sh writes them, or this folder's wall/old-N.json and wall/new-N.json)."""
import glob
import json
import statistics as st
import sys

folder = sys.argv[1] if len(sys.argv) > 1 else "wall"
medians = {}
for side in ("old", "new"):
    ratios, native, kvcached = [], [], []
    for path in sorted(glob.glob(f"{folder}/{side}-*/scheduler_decode_full.json") + glob.glob(f"{folder}/{side}-*.json")):
        for row in json.load(open(path))["rows"]:
            d = row["summary"]["decode_steps"]
            ratios += d["ratios"]
            native += d["native_s"]
            kvcached += d["kvcached_s"]
    medians[side] = st.median(ratios)
    print(f"{side}: {len(ratios)} rounds, decode-step ratio {st.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
          f"native {st.median(native) * 1e3:.3f} ms, kvcached {st.median(kvcached) * 1e3:.3f} ms")
print(f"after / before: {medians['new'] / medians['old']:.3f}")
