#!/bin/bash
# session 7 call 3: #12 GRPO under DeepCompile (eval region fix) + torch_adam cells at 30 GiB
B="python3 benchmarks/memory/bench_memory.py --build plain --ckpt default --steps 12 --timeout 400"
BENCH_TAG=_i $B --optim torch --cap 30 --settings dc_default,ours --jobs 2 > $OUT/phase_i.log 2>&1 &
timeout 570 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_runtime_gpu.py -k grpo -x > $OUT/gpu_grpo.log 2>&1 &
wait
cp benchmarks/memory/memory_i*.json $OUT/ 2>/dev/null
tail -3 $OUT/gpu_grpo.log
grep -h '^{' $OUT/phase_i.log | python3 -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l); print(r['setting'][:22], r['optim'], r['cap_gib'], r['status'][:200], round(r.get('peak_alloc_gib',0),2), round(r.get('peak_reserved_gib',0),2), r.get('median_step_s'), r.get('persistent'), r.get('calibrated'), r.get('gate_tighten_gib'), r.get('prefetch_deferred'))"
