#!/bin/bash
# session 14, call 2 (`CALL_LIMIT=585 bash benchmarks/gpu_calls/session14_call2.sh`, carry .whl):
# #14 — after call 1 found the fused rope kernel refused by Triton inside a compiled graph (fp64
# scale), fixed in faf3063: its GPU kernel tests, then the decode benchmark (median of 3 timed
# calls a row) at batch 64 with and without the fusion and run-ahead, at sync_every 8 and 1, the
# default row again at the end (host drift); batch 8 with the fused kernel forced at every batch;
# then the compiled-decode GPU test with what time is left.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
LIMIT=${CALL_LIMIT:-590}
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_gqa_decode_kernel_gpu.py > $OUT/kernel_test.log 2>&1; echo "kernel gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/kernel_test.log | cut -c1-300; grep -m10 "^E  \|Error" $OUT/kernel_test.log | cut -c1-400
bench() {  # $1: batches, $2: configs, $3: seconds, $4: name of the files kept
  BENCH_BATCHES=$1 BENCH_CONFIGS=$2 timeout $3 python3 benchmarks/generation/bench_decode.py > $OUT/bench_$4.log 2>&1
  echo "decode $4 rc=$? at ${SECONDS}s"
  cp $OUT/decode_partial.jsonl $OUT/rows_$4.jsonl 2>/dev/null
  grep -A14 "^| batch" $OUT/bench_$4.log | cut -c1-300
  grep "^measured" $OUT/bench_$4.log | cut -c1-150
  grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench_$4.log | cut -c1-400
}
bench 64 hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_fused_rope,hf_zero3_graphs_rope_ahead,hf_zero3_graphs_ahead,hf_zero3_graphs_sync1,hf_zero3_graphs_sync1_ahead,hf_zero3_graphs_sync1_rope_ahead,hf_zero3_graphs 250 b64
left=$((LIMIT - SECONDS - 100))
bench 8 hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_rope_always,hf_zero3_graphs_sync1,hf_zero3_graphs_sync1_ahead $((left < 190 ? left : 190)) b8
rm -f $OUT/decode_partial.jsonl
left=$((LIMIT - SECONDS - 5))
timeout $left python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:\|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-500
