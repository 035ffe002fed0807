#!/bin/bash
# session 8 call 4 (1x H200, the session's last minutes): #13 torch_adam cells on the new axes at
# 30 GiB (plain ZeRO-3 and hf_zero3's default, four jobs at once, 8 steps).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
BENCH_TAG=_s8i timeout 270 python3 benchmarks/memory/bench_memory.py --optim torch --steps 8 --timeout 260 \
  --build zero_init,plain --ckpt nonreentrant,default --cap 30 --settings ours,plain --jobs 4 > $OUT/mem_i.log 2>&1
grep -h '^{' $OUT/mem_i.log | python3 benchmarks/gpu_calls/rows.py
