#!/bin/bash
# session 8 call 2 (1x H200): #14 hf_zero3's static decode loop with CUDA graphs: GPU test, then the
# decode benchmark alone on the GPU; then, if time is left, one #13 cell alone (plain build, non-reentrant).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_decode.log 2>&1
tail -3 $OUT/gpu_decode.log; grep -m3 "Error\|assert" $OUT/gpu_decode.log
timeout $((560 - SECONDS)) python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null
grep -A20 "^| batch\|^batch" $OUT/bench_decode.log | head -16; tail -2 $OUT/bench_decode.log
left=$((575 - SECONDS))
if [ $left -gt 200 ]; then
  BENCH_TAG=_s8e timeout $left python3 benchmarks/memory/bench_memory.py --optim fused --steps 10 --timeout $((left - 10)) \
    --build plain --ckpt nonreentrant --cap 29 --settings ours > $OUT/mem_e.log 2>&1
  grep -h '^{' $OUT/mem_e.log | python3 benchmarks/gpu_calls/rows.py
fi
