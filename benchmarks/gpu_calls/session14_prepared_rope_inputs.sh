#!/bin/bash
# prepared in session 14 for the next session, NOT RUN (no device time left; run it as
# `CALL_LIMIT=585 bash benchmarks/gpu_calls/session14_prepared_rope_inputs.sh`, carry .whl):
# #14 — the fused rope kernel now reads the loop's 2-D padding mask in place and cos/sin through
# hf_zero3::decode_rotary_rows (session 14's call 3 trace: three input-building kernels a layer
# kept the fusion from paying). Its GPU kernel tests (with the new once-a-step check), the
# compiled-decode GPU test (fusion on), then the decode benchmark at batch 64 with and without
# the fusion (median of three calls a row, the default row again last for drift), then one traced
# call of each to count the step's kernels. If the fused row is faster and its kernels fewer by
# ~48 a step, make HF_ZERO3_FUSE_ROPE default on (decode_attention.rope_enabled).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
LIMIT=${CALL_LIMIT:-590}
timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_gqa_decode_kernel_gpu.py > $OUT/kernel_test.log 2>&1; echo "kernel gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/kernel_test.log | cut -c1-300; grep -m10 "^E  \|Error\|kernels computing" $OUT/kernel_test.log | cut -c1-400
timeout 120 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:\|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-500
left=$((LIMIT - SECONDS - 130))
BENCH_BATCHES=64 BENCH_CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_fused_rope,hf_zero3_graphs_sync1,hf_zero3_graphs \
  timeout $((left < 230 ? left : 230)) python3 benchmarks/generation/bench_decode.py > $OUT/bench.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp $OUT/decode_partial.jsonl $OUT/rows.jsonl 2>/dev/null; rm -f $OUT/decode_partial.jsonl
grep -A10 "^| batch" $OUT/bench.log | cut -c1-300; grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench.log | cut -c1-400
left=$((LIMIT - SECONDS - 5))
if [ $left -gt 90 ]; then
PROFILE_TIMELINE=1 BENCH_BATCHES=64 PROFILE_VARIANTS="default;rope:HF_ZERO3_FUSE_ROPE=1" timeout $left \
  python3 benchmarks/generation/profile_decode.py > $OUT/timeline.log 2>&1; echo "timeline rc=$? at ${SECONDS}s"
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/timeline.log"):
    if l.startswith("{"):
        r = json.loads(l)
        top, big = r.pop("top_kernels", None), r.pop("largest", None)
        print(r)
        for t in (top or [])[:16]:
            print("   ", t)
PY
fi
