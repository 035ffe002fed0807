#!/bin/bash
# session 7: timing, alone on the GPU: #14 decode benchmark, then #13 uncapped speed
timeout 230 python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$?"
tail -14 $OUT/bench_decode.log
BENCH_TAG=_j timeout 270 python3 benchmarks/memory/bench_memory.py --build plain --ckpt default --optim fused --steps 10 --cap 0 --settings dc_default,ours --jobs 2 --timeout 260 > $OUT/phase_j.log 2>&1
cp benchmarks/memory/memory_j*.json benchmarks/generation/decode*.json $OUT/ 2>/dev/null
grep -h '^{' $OUT/phase_j.log | python3 -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l); print(r['setting'][:22], r['optim'], r['cap_gib'], r['status'][:200], round(r.get('peak_alloc_gib',0),2), round(r.get('peak_reserved_gib',0),2), r.get('median_step_s'), r.get('persistent'), r.get('calibrated'), r.get('gate_tighten_gib'), r.get('prefetch_deferred'))"
