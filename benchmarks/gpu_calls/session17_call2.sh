#!/bin/bash
# Session 17, call 2 (#14): the fused q/k/v projection through the dependent split-K GEMM, its
# float32 partials summed in the rope kernel (HF_ZERO3_TRITON_QKV, on with dependent launches):
# (1) the kernel GPU tests and the dependent-launch tests (the new one: partials vs cuBLAS's
# projection, compiled and replayed); (2) batch 64: static cache, defaults and
# HF_ZERO3_TRITON_QKV=0 alternating, twice each, same run.
# Run as `CALL_LIMIT=585 bash benchmarks/gpu_calls/session17_call2.sh` (carry .whl).
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-585}
gpu_pytest "kernel + dependent gpu tests" 150 kernel_test.log tests/gpu/test_dependent_launch_gpu.py tests/gpu/test_gqa_decode_kernel_gpu.py
left=$((LIMIT - SECONDS - 5))
BENCH_BATCHES=64 BENCH_CONFIGS=hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_cublas_qkv,hf_zero3_graphs,hf_zero3_graphs_cublas_qkv \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
python3 benchmarks/gpu_calls/decode_rows.py
