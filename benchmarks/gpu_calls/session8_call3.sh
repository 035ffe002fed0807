#!/bin/bash
# session 8 call 3 (1x H200): #14 decode benchmark again, alone (call 2's HF baselines kept
# ZeRO-3's hooks on under GatheredParameters); then #13 cells four at once on the card, with the
# memory plan in the allocator's units (call 1 refused 4 of 6 such cells: BudgetTooSmallError).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 250 python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null
grep -A12 "^| batch" $OUT/bench_decode.log
python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" > /dev/null 2>&1
left=$((570 - SECONDS))
B="python3 benchmarks/memory/bench_memory.py --steps 10 --timeout $((left - 15))"
BENCH_TAG=_s8f timeout $left $B --optim fused --build zero_init --ckpt default --cap 29 --settings ours > $OUT/mem_f.log 2>&1 &
BENCH_TAG=_s8g timeout $left $B --optim fused --build plain --ckpt nonreentrant --cap 28 29 --settings ours --jobs 2 > $OUT/mem_g.log 2>&1 &
BENCH_TAG=_s8h timeout $left $B --optim fused --build zero_init --ckpt nonreentrant --cap 28 --settings ours > $OUT/mem_h.log 2>&1 &
wait
grep -h '^{' $OUT/mem_*.log | python3 benchmarks/gpu_calls/rows.py
grep -h "BudgetTooSmall\|OutOfMemory" $OUT/mem_*.log | sort | uniq -c | head -5
