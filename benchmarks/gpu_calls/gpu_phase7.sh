#!/bin/bash
# session 7 call 2: #12 GRPO under DeepCompile (eval region fix), #13 user-config GPU test (final rule) + torch_adam cells
B="python3 benchmarks/memory/bench_memory.py --build plain --ckpt default --steps 12 --timeout 260"
BENCH_TAG=_h $B --optim torch --cap 28 30 --settings plain,ours --jobs 2 > $OUT/phase_h.log 2>&1 &
timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_runtime_gpu.py -k grpo -x > $OUT/gpu_grpo.log 2>&1 &
timeout 570 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_memory_plan.py -k user_configuration > $OUT/gpu_user.log 2>&1 &
wait
cp benchmarks/memory/memory_h*.json $OUT/ 2>/dev/null
tail -3 $OUT/gpu_grpo.log; grep "user config\|passed\|failed" $OUT/gpu_user.log | tail -4
grep -h '^{' $OUT/phase_h.log | python3 -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l); print(r['setting'][:22], r['optim'], r['cap_gib'], r['status'][:200], round(r.get('peak_alloc_gib',0),2), round(r.get('peak_reserved_gib',0),2), r.get('median_step_s'), r.get('persistent'), r.get('calibrated'), r.get('gate_tighten_gib'), r.get('prefetch_deferred'))"
