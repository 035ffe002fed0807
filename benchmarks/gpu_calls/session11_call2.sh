#!/bin/bash
# session 11 call 2 (1x H200): #14 after call 1 (the Triton decode attention failed inside inductor:
# a float scale arrived as fp64; built inside Dynamo's trace): the kernel's GPU test, the
# compiled-decode GPU test, the decode benchmark (Triton attention and MLP GEMMs vs the PyTorch
# attention and cuBLAS, same run), then the decode-GEMM probe.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 90 python3 -m pytest -q -m gpu tests/gpu/test_gqa_decode_kernel_gpu.py > $OUT/kernel_test.log 2>&1; echo "kernel test rc=$? at ${SECONDS}s"
tail -1 $OUT/kernel_test.log | cut -c1-300; grep -m8 "^E  " $OUT/kernel_test.log | cut -c1-300
timeout 120 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:" $OUT/gpu_test.log | cut -c1-400
export BENCH_CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_cublas_mlp,hf_zero3_graphs_torch_attention
left=$((500 - SECONDS))
BENCH_BATCHES=64,8 timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null; cp $OUT/decode_partial.jsonl $OUT/partial.jsonl 2>/dev/null
grep -A12 "^| batch" $OUT/bench_decode.log | cut -c1-420
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench_decode.log | cut -c1-400
left=$((588 - SECONDS))
if [ $left -gt 40 ]; then
  timeout $left python3 benchmarks/generation/decode_gemm_probe.py > $OUT/gemm_probe.log 2>&1; echo "gemm probe rc=$? at ${SECONDS}s"
  grep "^| \|Error" $OUT/gemm_probe.log | cut -c1-220 | head -20
else echo "gemm probe not run: ${left}s left"; fi
