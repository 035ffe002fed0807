#!/bin/bash
# prepared in session 13 for the next session, NOT RUN (session 13's second call was refused: no device lent;
# run it as `CALL_LIMIT=585 bash benchmarks/gpu_calls/session13_prepared_rope.sh`, carry .whl):
# #14 — the rotary embedding and the k/v cache write moved into the Triton decode attention
# (HF_ZERO3_FUSE_ROPE=1, opt-in until this runs): its GPU kernel tests (bf16/fp32 against float32
# math; compiled + CUDA-graph replay writing the caller's cache in place), the compiled-decode GPU
# test, the attention probe (unfused vs fused, launch settings), then the decode benchmark at batch 64 (the batch the Triton attention runs at) with and
# without the fusion, same run, and a kernel profile of one step if time is left.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_gqa_decode_kernel_gpu.py > $OUT/kernel_test.log 2>&1; echo "kernel gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/kernel_test.log | cut -c1-300; grep -m10 "^E  \|Error" $OUT/kernel_test.log | cut -c1-400
timeout 110 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:\|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-500
timeout 90 python3 benchmarks/generation/attention_probe.py > $OUT/attention_probe.log 2>&1; echo "attention probe rc=$? at ${SECONDS}s"
cp benchmarks/generation/attention_probe.json $OUT/ 2>/dev/null; grep "^|" $OUT/attention_probe.log | cut -c1-200
export BENCH_CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_fused_rope,hf_zero3_graphs_sync1,hf_zero3_graphs_sync1_ahead,hf_zero3_graphs_ahead
left=$((${CALL_LIMIT:-590} - SECONDS - 150))
BENCH_BATCHES=64 timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null; cp $OUT/decode_partial.jsonl $OUT/partial.jsonl 2>/dev/null
grep -A8 "^| batch" $OUT/bench_decode.log | cut -c1-440
grep "^measured" $OUT/bench_decode.log | cut -c1-170
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench_decode.log | cut -c1-400
left=$((${CALL_LIMIT:-590} - SECONDS - 5))
if [ $left -gt 100 ]; then
HF_ZERO3_FUSE_ROPE=1 PROFILE_TIMELINE=1 BENCH_BATCHES=64 timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/timeline.log 2>&1; echo "timeline rc=$? at ${SECONDS}s"
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/timeline.log"):
    if l.startswith("{"):
        r = json.loads(l)
        big = r.pop("largest", None)
        top = r.pop("top_kernels", None)
        print(r)
        for t in top or []:
            print("   ", t)
        for g in (big or [])[:6]:
            print("   ", g)
PY
fi
