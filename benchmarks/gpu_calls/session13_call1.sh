#!/bin/bash
# session 13 call 1 (1x H200): where the GPU waits in one warm compiled rollout (issue #14, batch 64 at
# 34.9 % of the floor): profile_decode's timeline of a warm call (host + GPU traced, no added syncs).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
PROFILE_TIMELINE=1 BENCH_BATCHES=64,8 timeout 400 python3 benchmarks/generation/profile_decode.py > $OUT/timeline.log 2>&1; echo "timeline rc=$? at ${SECONDS}s"
cp benchmarks/generation/profile_decode.json $OUT/profile_decode_timeline.json 2>/dev/null
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/timeline.log"):
    if not l.startswith("{"):
        continue
    r = json.loads(l)
    big = r.pop("largest", None)
    print(r)
    for g in big or []:
        print("   ", g)
PY
grep -m5 "Error\|Traceback" $OUT/timeline.log | cut -c1-300
tail -5 $OUT/timeline.log | cut -c1-300
