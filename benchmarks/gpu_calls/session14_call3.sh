#!/bin/bash
# session 14, call 3 (`CALL_LIMIT=560 bash benchmarks/gpu_calls/session14_call3.sh`, carry .whl):
# #14 — TRL GRPO through the static loop after this session's graph-size change; then why call 2
# found run-ahead slower at batch 64 (+8 %) and the fused rope no faster end to end than its probe
# promised: one warm call traced (host + GPU) per variant, same process, batch 64 then batch 8.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
LIMIT=${CALL_LIMIT:-560}
timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_runtime_gpu.py -k static_loop > $OUT/runtime_test.log 2>&1; echo "runtime static_loop gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/runtime_test.log | cut -c1-300; grep -m8 "^E  \|hf_zero3 lockstep" $OUT/runtime_test.log | cut -c1-400
summary() {
python3 - "$1" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    if not l.startswith("{"):
        continue
    r = json.loads(l)
    if r["what"] == "warmup":
        print("warmup", r["variant"], r["batch"], round(r["seconds"], 4), r["graphs_reused"])
        continue
    big, top = r.pop("largest", []), r.pop("top_kernels", [])
    print({k: v for k, v in r.items()})
    for t in top[:14]:
        print("   ", t[0][:90], t[1], t[2])
    for g in big[:5]:
        print("   gap", g)
PY
}
left=$((LIMIT - SECONDS - 110))
PROFILE_TIMELINE=1 BENCH_BATCHES=64 PROFILE_VARIANTS="default;ahead:HF_ZERO3_RUN_AHEAD=1;rope:HF_ZERO3_FUSE_ROPE=1;sync1:sync=1;sync1_ahead:sync=1,HF_ZERO3_RUN_AHEAD=1" \
  timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/timeline64.log 2>&1; echo "timeline 64 rc=$? at ${SECONDS}s"
summary $OUT/timeline64.log; grep -m3 "Error\|hf_zero3 lockstep" $OUT/timeline64.log | cut -c1-300
left=$((LIMIT - SECONDS - 5))
if [ $left -gt 80 ]; then
PROFILE_TIMELINE=1 BENCH_BATCHES=8 PROFILE_VARIANTS="default;sync1:sync=1;sync1_ahead:sync=1,HF_ZERO3_RUN_AHEAD=1" \
  timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/timeline8.log 2>&1; echo "timeline 8 rc=$? at ${SECONDS}s"
summary $OUT/timeline8.log
fi
