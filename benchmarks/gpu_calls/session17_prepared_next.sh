#!/bin/bash
# Prepared in session 17 for the next session, NOT RUN (device time spent). Run as
# `CALL_LIMIT=585 bash benchmarks/gpu_calls/session17_prepared_next.sh` (carry .whl).
# #14, batch 64 at 37.5-39.8 % of the floor depending on the host, 40 % asked. (1) the q/k/v
# partials GPU test after the unmasked GEMM tiles (call 3 of session 17 cut it off); (2) how much
# two loop instances of one process differ (session 17, call 3: 5 %): defaults and run-ahead three
# times each, alternating; (3) the prompt's forward with a C++ wrapper (never run on a GPU).
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-585}
gpu_pytest "dependent launch gpu tests" 150 pdl_test.log tests/gpu/test_dependent_launch_gpu.py
left=$((LIMIT - SECONDS - 5))
BENCH_BATCHES=64 BENCH_CONFIGS=hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_ahead,hf_zero3_graphs,hf_zero3_graphs_ahead,hf_zero3_graphs,hf_zero3_graphs_ahead,hf_zero3_graphs_cpp_prefill \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
python3 benchmarks/gpu_calls/decode_rows.py
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
