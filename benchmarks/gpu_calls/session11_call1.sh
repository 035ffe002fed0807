#!/bin/bash
# session 11 call 1 (1x H200): #14 with the Triton decode attention (hf_zero3.kernels.gqa_decode),
# the prefill without DeepSpeed's per-linear autograd Function, and greedy argmax without the
# float32 logits copy: the kernel's GPU test, the compiled-decode GPU test, the decode benchmark
# (kernel vs PyTorch decode attention, same run) and a profile of the batch-64 step.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_gqa_decode_kernel_gpu.py > $OUT/kernel_test.log 2>&1; echo "kernel test rc=$? at ${SECONDS}s"
tail -2 $OUT/kernel_test.log | cut -c1-300; grep -m6 "^E  " $OUT/kernel_test.log | cut -c1-300
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"
tail -2 $OUT/gpu_test.log | cut -c1-300; grep -m6 "^E  " $OUT/gpu_test.log | cut -c1-300
export BENCH_CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_torch_attention
BENCH_BATCHES=64,8 timeout 330 python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null; cp $OUT/decode_partial.jsonl $OUT/partial.jsonl 2>/dev/null
grep -A12 "^| batch" $OUT/bench_decode.log | cut -c1-400
grep -m5 "Error\|error:" $OUT/bench_decode.log | cut -c1-300
left=$((585 - SECONDS))
if [ $left -gt 90 ]; then
  PROFILE_MODES=default BENCH_BATCHES=64 timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/profile.log 2>&1; echo "profile rc=$? at ${SECONDS}s"
  cp benchmarks/generation/profile_decode.json $OUT/ 2>/dev/null
  grep '"what": "kernels"\|"what": "phases"\|"what": "prefill_kernels"' $OUT/profile.log | cut -c1-600
else echo "profile not run: ${left}s left"; fi
