#!/bin/bash
# Prepared in session 18 for a later session, NOT RUN (device time spent). Run as
# `CALL_LIMIT=585 bash benchmarks/gpu_calls/session18_prepared_next.sh` (carry .whl). What session
# 18 did not run on its commits: (1) TRL's GRPO rollouts through the static loop; (2) the decode
# table at batch 64 and 8 on another host (session 18's was a fast one), with the prompt forward
# eager and with a C++ wrapper now that its 16 host syncs are gone.
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-585}
gpu_pytest "TRL static-loop gpu test" 150 trl_test.log tests/gpu/test_runtime_gpu.py -k static_loop
left=$((LIMIT - SECONDS - 5))
BENCH_BATCHES=64,8 BENCH_CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_eager_prefill,hf_zero3_graphs,hf_zero3_graphs_cpp_prefill \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
python3 benchmarks/gpu_calls/decode_rows.py
grep -A16 "^batch" $OUT/bench.log | cut -c1-200 | head -18
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench.log | cut -c1-400
