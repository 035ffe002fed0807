#!/bin/bash
# session 9 call 4 (1x H200): #14 with the cache's small tensors handed back to a new 5.17 cache
# (call 3: the GPU test's back-to-back call re-captured, its new cache's length counters moved):
# the GPU decode test, then the decode benchmark.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "gpu test rc=$? at ${SECONDS}s"
tail -2 $OUT/gpu_test.log; grep "^E " $OUT/gpu_test.log | head -5 | cut -c1-300
left=$((560 - SECONDS))
timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null
grep -A16 "^| batch" $OUT/bench_decode.log | cut -c1-330
