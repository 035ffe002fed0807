#!/bin/bash
# session 10 call 3 (1x H200): #14 after the engine-hook fix (DeepSpeed's forward prologue in the
# compiled step stopped GRPO's third rollout): all of tests/gpu/test_runtime_gpu.py (GRPO through
# the static loop, GRPO under DeepCompile, two DeepCompile engines) with decode="auto" as the
# default, the compiled-decode GPU test, then the Trainer-under-DeepCompile eval test if time is left.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_runtime_gpu.py -k static_loop > $OUT/grpo_static.log 2>&1; echo "grpo static-loop test rc=$? at ${SECONDS}s"
tail -1 $OUT/grpo_static.log | cut -c1-300; grep "^rollouts:" $OUT/grpo_static.log | cut -c1-1200
timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_decode.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_decode.log
timeout 330 python3 -m pytest -q -m gpu tests/gpu/test_runtime_gpu.py -k "not static_loop" > $OUT/runtime_rest.log 2>&1; echo "runtime rest rc=$? at ${SECONDS}s"
tail -3 $OUT/runtime_rest.log | cut -c1-300; grep -m4 "^E  .*Error\|^E  .*assert" $OUT/runtime_rest.log | cut -c1-300
left=$((585 - SECONDS))
if [ $left -gt 150 ]; then
  timeout $left python3 -m pytest -q -m gpu tests/gpu/test_deepcompile_eval.py -k trainer_eval > $OUT/trainer_eval.log 2>&1; echo "trainer eval rc=$? at ${SECONDS}s"
  tail -2 $OUT/trainer_eval.log | cut -c1-300; grep -m4 "^E  .*Error\|^E  .*assert" $OUT/trainer_eval.log | cut -c1-300
else echo "trainer eval not run: ${left}s left"; fi
