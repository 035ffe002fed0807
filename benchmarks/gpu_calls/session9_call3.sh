#!/bin/bash
# session 9 call 3 (1x H200): #14 after keying graph reuse on every cache tensor (call 2's GPU test
# hit a stale length counter: transformers 5.17 builds a new StaticCache each call): the GPU
# decode test, the decode benchmark (same tokens on both calls), kernels of a batch-64 step.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "gpu test rc=$? at ${SECONDS}s"
tail -3 $OUT/gpu_test.log; grep -m3 "^E  .*Error\|assert" $OUT/gpu_test.log | cut -c1-300
timeout 280 python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null
grep -A16 "^| batch" $OUT/bench_decode.log | cut -c1-330
grep -o "'config': '[a-z0-9_]*'\|'same_tokens_both_calls': [A-Za-z]*" $OUT/bench_decode.log | paste - - | head -12
left=$((575 - SECONDS))
PROFILE_MODES=default BENCH_BATCHES=64 timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/profile.log 2>&1; echo "profile rc=$? at ${SECONDS}s"
grep '^{"what' $OUT/profile.log | cut -c1-1500
