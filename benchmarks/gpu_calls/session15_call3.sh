#!/bin/bash
# Session 15, call 3 (#14): HF_ZERO3_FUSE_ROPE is now on by default (call 2: 64 kernels a step
# fewer, 2.2-2.8 % faster at batch 64). The compiled-decode GPU test and the GRPO rollouts through
# the static loop with the new default, then the decode table: batch 64 (defaults, the fusion off,
# sync_every=1, defaults again for drift) and batch 8. Run as
# `CALL_LIMIT=560 bash benchmarks/gpu_calls/session15_call3.sh` (carry .whl).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
LIMIT=${CALL_LIMIT:-560}
timeout 120 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:\|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-500
timeout 110 python3 -m pytest -q -s -m gpu tests/gpu/test_runtime_gpu.py -k static_loop > $OUT/runtime_test.log 2>&1; echo "runtime static_loop gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/runtime_test.log | cut -c1-300; grep -m8 "^E  \|rope_attention\|hf_zero3 lockstep" $OUT/runtime_test.log | cut -c1-400
for B in 64 8; do
  if [ $B = 64 ]; then C=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_no_rope,hf_zero3_graphs_sync1,hf_zero3_graphs; else C=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs; fi
  left=$((LIMIT - SECONDS - 10))
  BENCH_BATCHES=$B BENCH_CONFIGS=$C timeout $((left < 220 ? left : 220)) python3 benchmarks/generation/bench_decode.py > $OUT/bench$B.log 2>&1; echo "decode batch $B rc=$? at ${SECONDS}s"
  mv $OUT/decode.json $OUT/decode$B.json 2>/dev/null; mv $OUT/decode_partial.jsonl $OUT/rows$B.jsonl 2>/dev/null
  grep -A9 "^| batch" $OUT/bench$B.log | cut -c1-300; grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench$B.log | cut -c1-400
done
