#!/bin/bash
# session 10 call 2 (1x H200): #14 with the fused q/k/v projections and decode="auto" as the
# default: the GRPO static-loop test (the reason now names what Dynamo could not trace), the
# compiled-decode GPU test, and the decode benchmark (fused and unfused graphs in the same run).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 200 python3 -m pytest -q -s -m gpu tests/gpu/test_runtime_gpu.py -k static_loop > $OUT/grpo_test.log 2>&1; echo "grpo test rc=$? at ${SECONDS}s"
tail -2 $OUT/grpo_test.log | cut -c1-300; grep "^rollouts:" $OUT/grpo_test.log | cut -c1-1500
timeout 160 python3 -m pytest -q -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "gpu test rc=$? at ${SECONDS}s"
tail -2 $OUT/gpu_test.log; grep -m4 "^E  .*Error\|^E  .*assert" $OUT/gpu_test.log | cut -c1-300
left=$((585 - SECONDS))
timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null; cp $OUT/decode_partial.jsonl $OUT/partial.jsonl 2>/dev/null
grep -A18 "^| batch" $OUT/bench_decode.log | cut -c1-360
grep -o "'config': '[a-z0-9_]*'\|'same_tokens_both_calls': [A-Za-z]*\|'fused_projections': [0-9A-Za-z]*" $OUT/bench_decode.log | paste - - - | head -14
