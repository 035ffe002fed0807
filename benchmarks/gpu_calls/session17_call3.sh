#!/bin/bash
# Session 17, call 3 (#14): the decode GEMMs load their tiles unmasked where the blocks divide the
# weight (EVEN; compiled for sm_90 with Triton 3.9 the masked kernels took 255 registers and
# spilled at 64 rows, 94-198 without). (1) dependent-launch GPU tests (16-layer GEMM stack, us per
# replay); (2) the GEMM probe at 64 rows, unmasked against masked tiles (PROBE_MASKED=1) and
# cuBLAS, same run; (3) the compiled-decode GPU test at the defaults; (4) the decode table:
# batch 64 (HF eager, static cache, defaults, HF_ZERO3_TRITON_QKV=0, defaults again) and batch 8
# (HF eager, static cache, defaults), five timed calls a row.
# Run as `CALL_LIMIT=590 bash benchmarks/gpu_calls/session17_call3.sh` (carry .whl).
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-590}
gpu_pytest "dependent launch gpu tests" 100 pdl_test.log tests/gpu/test_dependent_launch_gpu.py
PROBE_MASKED=1 PROBE_ROWS=64 timeout 110 python3 benchmarks/generation/decode_gemm_probe.py > $OUT/gemm_probe.log 2>&1; echo "gemm probe rc=$? at ${SECONDS}s"
grep -A20 "^| shape" $OUT/gemm_probe.log | cut -c1-220
gpu_pytest "compiled decode gpu test" 160 gpu_test.log tests/gpu/test_compiled_decode_gpu.py
left=$((LIMIT - SECONDS - 100))
BENCH_BATCHES=64 BENCH_CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_cublas_qkv,hf_zero3_graphs \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
mv $OUT/decode.json $OUT/decode64.json 2>/dev/null; python3 benchmarks/gpu_calls/decode_rows.py; rm -f $OUT/decode_partial.jsonl
grep -A7 "^| batch" $OUT/bench64.log | cut -c1-330; grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
left=$((LIMIT - SECONDS - 5))
BENCH_BATCHES=8 BENCH_CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench8.log 2>&1; echo "decode batch 8 rc=$? at ${SECONDS}s"
mv $OUT/decode.json $OUT/decode8.json 2>/dev/null; python3 benchmarks/gpu_calls/decode_rows.py
grep -A5 "^| batch" $OUT/bench8.log | cut -c1-330
