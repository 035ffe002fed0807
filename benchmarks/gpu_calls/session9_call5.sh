#!/bin/bash
# session 9 call 5 (1x H200): #14/#12 TRL's GRPO rollouts through the static loop with CUDA graphs
# (Zero3Safe(decode="compiled"), plain ZeRO-3, Qwen2 GQA shape, bf16, 3 steps). Ran once (found the
# input-require-grads hook stopping the compiled step on torch 2.11); the re-run after the fix
# was refused: no device time left.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 200 python3 -m pytest -q -s -m gpu tests/gpu/test_runtime_gpu.py -k static_loop > $OUT/grpo_test.log 2>&1; echo "grpo test rc=$? at ${SECONDS}s"
tail -2 $OUT/grpo_test.log; grep "^E " $OUT/grpo_test.log | head -8 | cut -c1-400
grep "^rollouts:" $OUT/grpo_test.log
