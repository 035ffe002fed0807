#!/bin/bash
# session 10 call 4 (1x H200): problem 1's eval-under-DeepCompile GPU tests that had not run since
# session 3's glue change (with decode="auto" now the default: lockstep declines compiled decoding
# beside DeepCompile), in the device time left.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout $((530 - SECONDS)) python3 -m pytest -q -m gpu -rA tests/gpu/test_deepcompile_eval.py -k "not trainer_eval" > $OUT/deepcompile_eval.log 2>&1; echo "deepcompile eval rc=$? at ${SECONDS}s"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/deepcompile_eval.log | tail -8 | cut -c1-300; grep -m4 "^E  .*Error\|^E  .*assert" $OUT/deepcompile_eval.log | cut -c1-300
