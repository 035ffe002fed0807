#!/bin/bash
# session 12 call 5 (1x H200, the session's last ~7 device minutes): #14 — the greedy tail's argmax
# in two stages (inductor does not split an argmax: 27.5 us a batch-64 step in call 4) and the next
# position moved into the tail; graphs of 1 step against 8 (calls 2 and 4's profiles had 1-step
# graphs 2.8 % faster per step): the compiled-decode GPU test, then the decode benchmark with every
# row issue #14 names plus the 1-step-graph row, batch 64 and 8, same run.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 100 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:\|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-500
export BENCH_CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs1,layerwise
left=$((${CALL_LIMIT:-400} - SECONDS))
BENCH_BATCHES=64,8 timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null; cp $OUT/decode_partial.jsonl $OUT/partial.jsonl 2>/dev/null
grep -A14 "^| batch" $OUT/bench_decode.log | cut -c1-440
grep "^measured" $OUT/bench_decode.log | cut -c1-170
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench_decode.log | cut -c1-400
