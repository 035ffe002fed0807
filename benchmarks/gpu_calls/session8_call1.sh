#!/bin/bash
# session 8 call 1 (1x H200): #12 GRPO under DeepCompile GPU test (recompile fixes), #13 matrix cells
# for the axes not yet run with the final calibration rule (fused Adam: zero.Init x both
# checkpointing modes, plain build x non-reentrant), plain ZeRO-3 at 27-29 GiB and hf_zero3's default at 28-29.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
python3 -c "import torch,deepspeed,transformers,accelerate,trl;print(torch.__version__,deepspeed.__version__,transformers.__version__,accelerate.__version__,trl.__version__)" >> $OUT/gpu.txt
# build the fused Adam op once before the cells race for its lock
python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" > $OUT/build_ops.log 2>&1
timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_runtime_gpu.py -k grpo -x > $OUT/gpu_grpo.log 2>&1 &
B="python3 benchmarks/memory/bench_memory.py --optim fused --steps 10 --timeout 330"
BENCH_TAG=_s8a timeout 520 $B --build zero_init --ckpt nonreentrant,default --cap 28 29 --settings ours --jobs 2 > $OUT/mem_ours_a.log 2>&1 &
BENCH_TAG=_s8b timeout 520 $B --build plain --ckpt nonreentrant --cap 28 29 --settings ours --jobs 1 > $OUT/mem_ours_b.log 2>&1 &
(BENCH_TAG=_s8c timeout 520 $B --build zero_init --ckpt nonreentrant,default --cap 27 28 29 --settings plain > $OUT/mem_plain_a.log 2>&1
 BENCH_TAG=_s8d timeout 170 $B --build plain --ckpt nonreentrant --cap 27 28 29 --settings plain > $OUT/mem_plain_b.log 2>&1) &
wait
cp benchmarks/memory/memory_s8*.json $OUT/ 2>/dev/null
tail -3 $OUT/gpu_grpo.log
grep -h '^{' $OUT/mem_*.log | python3 benchmarks/gpu_calls/rows.py
