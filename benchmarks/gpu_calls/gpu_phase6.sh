#!/bin/bash
# session 7 call 1: GPU tests (#12 GRPO under DeepCompile, #14 compiled decode) + #13 final calibration rule cells
B="python3 benchmarks/memory/bench_memory.py --optim fused --build plain --ckpt default --steps 12 --timeout 500"
BENCH_TAG=_g $B --cap 28 29 30 --settings ours --jobs 3 > $OUT/phase_g.log 2>&1 &
timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_runtime_gpu.py -k grpo -x > $OUT/gpu_grpo.log 2>&1 &
timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_decode.log 2>&1 &
wait
cp benchmarks/memory/memory_g*.json $OUT/ 2>/dev/null
tail -3 $OUT/gpu_grpo.log; tail -3 $OUT/gpu_decode.log
grep -h '^{' $OUT/phase_g.log | python3 -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l); print(r['setting'][:22], r['cap_gib'], r['status'][:200], round(r.get('peak_alloc_gib',0),2), round(r.get('peak_reserved_gib',0),2), r.get('median_step_s'), r.get('persistent'), r.get('calibrated'), r.get('gate_tighten_gib'), r.get('prefetch_deferred'))"
