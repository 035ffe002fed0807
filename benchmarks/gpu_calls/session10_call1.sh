#!/bin/bash
# session 10 call 1 (1x H200): #14 the GRPO re-run after f51a4fc (TRL's rollouts through the
# static loop's graphs), the GEMM fusion probe, and where a batch-64 rollout's time goes (decode
# step kernels, prefill kernels, host profile of a warm call; default and combo_kernels modes).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
timeout 220 python3 -m pytest -q -s -m gpu tests/gpu/test_runtime_gpu.py -k static_loop > $OUT/grpo_test.log 2>&1; echo "grpo test rc=$? at ${SECONDS}s"
tail -2 $OUT/grpo_test.log; grep "^E " $OUT/grpo_test.log | head -8 | cut -c1-400
grep "^rollouts:" $OUT/grpo_test.log
timeout 90 python3 benchmarks/generation/gemm_fusion_probe.py > $OUT/probe.log 2>&1; echo "probe rc=$? at ${SECONDS}s"
cp benchmarks/generation/gemm_fusion_probe.json $OUT/ 2>/dev/null
left=$((580 - SECONDS))
PROFILE_MODES=default,combo BENCH_BATCHES=64 timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/profile.log 2>&1; echo "profile rc=$? at ${SECONDS}s"
cp benchmarks/generation/profile_decode.json $OUT/ 2>/dev/null
grep '^{"what": "\(phases\|kernels\|prefill_kernels\|first_call\)' $OUT/profile.log | cut -c1-700
