"""Print bench_memory's JSON rows (read from stdin) one line each, for a GPU call's output tail."""
import json
import sys

for line in sys.stdin:
    r = json.loads(line)
    print(r["setting"][:22], r.get("optim"), r.get("build"), r.get("ckpt"), r["cap_gib"], r["status"][:160],
          round(r.get("peak_alloc_gib", 0), 2), round(r.get("peak_reserved_gib", 0), 2), r.get("median_step_s"),
          r.get("persistent"), r.get("calibrated"), r.get("gate_tighten_gib"), r.get("prefetch_deferred"))
