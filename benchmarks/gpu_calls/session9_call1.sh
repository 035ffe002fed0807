#!/bin/bash
# session 9 call 1 (1x H200): #14 where a compiled rollout's time goes (phases, kernels of one
# step, graph sizes 8/1/0, inductor default vs max-autotune, addresses across calls).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
nvidia-smi --query-gpu=name,memory.used,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 570 python3 benchmarks/generation/profile_decode.py > $OUT/profile.log 2>&1; echo "profile rc=$? at ${SECONDS}s"
cp benchmarks/generation/profile_decode.json $OUT/ 2>/dev/null
grep '^{' $OUT/profile.log | cut -c1-400
tail -5 $OUT/profile.log
