"""A GPU call's output tail for the decode benchmarks: ``python3 decode_rows.py`` prints
bench_decode's rows as measured ($OUT/decode_partial.jsonl), one line each; ``--timeline`` prints
profile_decode's traced calls ($OUT/timeline.log) with their top kernels; ``--events`` its untraced
phase stamps ($OUT/events.log: phase@host ms/GPU lag ms, the decode steps' own stamps left out)."""
import json
import os
import sys

out = os.environ["OUT"]
if "--events" in sys.argv:  # profile_decode's PROFILE_EVENTS rows ($OUT/events.log): phases outside the steps
    for line in open(os.path.join(out, "events.log")):
        if line.startswith("{") and '"events"' in line:
            r = json.loads(line)
            keep = [st for st in r["stamps"] if "_Runner.run" not in st[0] and "_Loop.finished" not in st[0]]
            print(r["variant"], "call_ms", r["call_ms"], " ".join(f"{st[0].split('.')[-1]}@{st[1]}/{st[3]}" for st in keep))
elif "--timeline" in sys.argv:
    for line in open(os.path.join(out, "timeline.log")):
        if line.startswith("{") and '"timeline"' in line:
            r = json.loads(line)
            print({k: r.get(k) for k in ("variant", "call_ms", "gpu_busy_ms", "gpu_idle_ms", "kernels",
                                         "kernels_overlapping", "kernel_overlap_ms")})
            for name, count, us in r["top_kernels"][:16]:
                print("   ", name[:90], count, round(us / 1e3, 2), round(us / max(count, 1), 2))
else:
    path = os.path.join(out, "decode_partial.jsonl")
    for line in open(path) if os.path.exists(path) else ():
        r = json.loads(line)
        print(r["config"], r.get("loop"), round(r["seconds"], 4), [round(s, 4) for s in r["seconds_all"]],
              "pdl", r.get("dependent_launches"), "compile", round(r["compile_s"], 1),
              "same", r.get("same_tokens_both_calls"), "captures", r.get("capture_s_all"))  # floor fraction: final table
