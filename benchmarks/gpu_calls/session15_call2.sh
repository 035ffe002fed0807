#!/bin/bash
# Session 15, call 2 (#14): the fused q/k/v projection's parts are now views of its one GEMM (no
# copy each: three kernels a layer in front of the fused rope kernel in call 1's trace) and the
# loop's per-call state key is cheaper. Kernel and compiled-decode GPU tests, then the decode bench
# at batch 64 and 8 with and without the fused rope kernel (each row twice: host drift), then one
# traced call of each at batch 64 (kernels a step). Run as
# `CALL_LIMIT=585 bash benchmarks/gpu_calls/session15_call2.sh` (carry .whl).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
LIMIT=${CALL_LIMIT:-590}
timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_gqa_decode_kernel_gpu.py > $OUT/kernel_test.log 2>&1; echo "kernel gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/kernel_test.log | cut -c1-300; grep -m10 "^E  \|Error\|kernels computing" $OUT/kernel_test.log | cut -c1-400
HF_ZERO3_FUSE_ROPE=1 timeout 120 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test (rope on) rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:\|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-500
CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_fused_rope,hf_zero3_graphs,hf_zero3_graphs_fused_rope
for B in 64 8; do
  left=$((LIMIT - SECONDS - 60))
  BENCH_BATCHES=$B BENCH_CONFIGS=$CONFIGS timeout $((left < 200 ? left : 200)) python3 benchmarks/generation/bench_decode.py > $OUT/bench$B.log 2>&1; echo "decode batch $B rc=$? at ${SECONDS}s"
  mv $OUT/decode.json $OUT/decode$B.json 2>/dev/null; rm -f $OUT/decode_partial.jsonl  # at most 8 files come back
  grep -A9 "^| batch" $OUT/bench$B.log | cut -c1-260; grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench$B.log | cut -c1-400
done
left=$((LIMIT - SECONDS - 5))
if [ $left -gt 80 ]; then
PROFILE_TIMELINE=1 BENCH_BATCHES=64 PROFILE_VARIANTS="default;rope:HF_ZERO3_FUSE_ROPE=1" timeout $left \
  python3 benchmarks/generation/profile_decode.py > $OUT/timeline.log 2>&1; echo "timeline rc=$? at ${SECONDS}s"
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/timeline.log"):
    if l.startswith("{") and '"timeline"' in l:
        r = json.loads(l)
        top, big = r.pop("top_kernels", None), r.pop("largest", None)
        print(r)
        for t in (top or [])[:14]:
            print("   ", t)
PY
fi
