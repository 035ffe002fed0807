#!/bin/bash
# (Record of a call as run. Since session 16's last commits HF_ZERO3_PDL is on by default without prefetch: the
# "pdl_no_prefetch" rows are today's hf_zero3_graphs, hf_zero3_graphs_no_pdl the old defaults.)
# Session 16, call 4 (#14): call 3 measured HF_ZERO3_PDL=1 5.7-6.0 % faster than the defaults at
# batch 64 (same run, two pairs). (1) the dependent-launch GPU tests (call 3's GEMM-stack test
# compared a compiled graph with eager through 16 unnormalized o_proj residuals, where bf16
# rounding compounds; now normed, and dependent vs plain graphs compared directly); (2) the
# compiled-decode GPU test with HF_ZERO3_PDL=1 (teacher-forced logits within tolerance of eager);
# (3) batch 8: defaults vs HF_ZERO3_PDL=1 without prefetch.
# Run as `CALL_LIMIT=480 bash benchmarks/gpu_calls/session16_call4.sh` (carry .whl).
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-480}
timeout 110 python3 -m pytest -q -s -m gpu tests/gpu/test_dependent_launch_gpu.py > $OUT/pdl_test.log 2>&1; echo "dependent launch gpu tests rc=$? at ${SECONDS}s"
tail -1 $OUT/pdl_test.log | cut -c1-300; grep -m12 "^E  \|us per replay\|Error" $OUT/pdl_test.log | cut -c1-400
HF_ZERO3_PDL=1 HF_ZERO3_PDL_PREFETCH=0 timeout 160 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test (PDL) rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:\|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-500
left=$((LIMIT - SECONDS - 5))
BENCH_BATCHES=8 BENCH_CONFIGS=hf_zero3_graphs,hf_zero3_graphs_pdl_no_prefetch,hf_zero3_graphs,hf_zero3_graphs_pdl_no_prefetch \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench8.log 2>&1; echo "decode batch 8 rc=$? at ${SECONDS}s"
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench8.log | cut -c1-400
python3 benchmarks/gpu_calls/decode_rows.py
