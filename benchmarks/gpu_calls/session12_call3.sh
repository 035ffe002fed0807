#!/bin/bash
# session 12 call 3 (1x H200): #14 — down and o_proj through the split-K Triton GEMM (call 2's
# probe: 1.17-1.35x cuBLAS; partials summed inside the consumer's kernel), on top of call 1's
# compiled prefill and greedy tail: the kernel and compiled-decode GPU tests, then the decode
# benchmark with every row issue #14 names (per-layer, HF eager gathered, transformers' static
# cache, ours) plus ours without split-K and with the prompt's forward eager, batch 64 and 8, same
# run; the GRPO static-loop test if time is left.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 70 python3 -m pytest -q -m gpu tests/gpu/test_gqa_decode_kernel_gpu.py > $OUT/kernel_test.log 2>&1; echo "kernel test rc=$? at ${SECONDS}s"
tail -1 $OUT/kernel_test.log | cut -c1-300; grep -m6 "^E  " $OUT/kernel_test.log | cut -c1-300
timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:\|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-500
export BENCH_CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_no_split,hf_zero3_graphs_eager_prefill,layerwise
left=$((520 - SECONDS))
BENCH_BATCHES=64,8 timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null; cp $OUT/decode_partial.jsonl $OUT/partial.jsonl 2>/dev/null
grep -A16 "^| batch" $OUT/bench_decode.log | cut -c1-440
grep "^measured" $OUT/bench_decode.log | cut -c1-200
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench_decode.log | cut -c1-400
left=$((592 - SECONDS))
if [ $left -gt 75 ]; then
  timeout $left python3 -m pytest -q -s -m gpu tests/gpu/test_runtime_gpu.py -k static_loop > $OUT/grpo_test.log 2>&1; echo "grpo test rc=$? at ${SECONDS}s"
  tail -1 $OUT/grpo_test.log | cut -c1-300; grep "^rollouts:" $OUT/grpo_test.log | cut -c1-900; grep -m4 "^E  " $OUT/grpo_test.log | cut -c1-300
else echo "grpo test not run: ${left}s left"; fi
