#!/bin/bash
# session 9 call 2 (1x H200): #14 after the grouped-heads decode attention and graphs kept across
# calls: the decode benchmark, the GPU decode test, then where a step's time goes (batch 8).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 300 python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null; cp $OUT/decode_partial.jsonl $OUT/partial.jsonl 2>/dev/null
grep -A16 "^| batch" $OUT/bench_decode.log | cut -c1-400
timeout 160 python3 -m pytest -q -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "gpu test rc=$? at ${SECONDS}s"
tail -3 $OUT/gpu_test.log
left=$((575 - SECONDS))
PROFILE_MODES=default BENCH_BATCHES=8 timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/profile.log 2>&1; echo "profile rc=$? at ${SECONDS}s"
grep '^{"what' $OUT/profile.log | cut -c1-700
