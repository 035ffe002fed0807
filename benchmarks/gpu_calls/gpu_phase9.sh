#!/bin/bash
# session 7: GRPO under DeepCompile, recompile reasons
export TORCH_LOGS="recompiles,graph_breaks" TORCH_LOGS_OUT=$OUT/dynamo.log
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_runtime_gpu.py -k grpo -x > $OUT/gpu_grpo.log 2>&1
tail -3 $OUT/gpu_grpo.log; grep -c . $OUT/dynamo.log; grep -i "recompil" -A6 $OUT/dynamo.log | head -60
