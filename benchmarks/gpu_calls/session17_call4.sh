#!/bin/bash
# Session 17, call 4 (#14): (1) TRL GRPO rollouts through the static loop with the session's
# defaults (dependent launches, q/k/v partials into the rope kernel, unmasked GEMM tiles); (2)
# batch 64, same run: defaults and HF_ZERO3_RUN_AHEAD=1 alternating (run-ahead stop agreements
# were measured mixed before dependent launches, session 14).
# Run as `CALL_LIMIT=300 bash benchmarks/gpu_calls/session17_call4.sh` (carry .whl).
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-300}
gpu_pytest "runtime static_loop gpu test" 110 runtime_test.log tests/gpu/test_runtime_gpu.py -k static_loop
left=$((LIMIT - SECONDS - 5))
BENCH_BATCHES=64 BENCH_CONFIGS=hf_zero3_graphs,hf_zero3_graphs_ahead,hf_zero3_graphs,hf_zero3_graphs_ahead \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
python3 benchmarks/gpu_calls/decode_rows.py
