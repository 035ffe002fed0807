#!/bin/bash
# Prepared in session 16 for the next session, NOT RUN (device time spent). Run as
# `CALL_LIMIT=585 bash benchmarks/gpu_calls/session16_prepared_next.sh` (carry .whl).
# #14 with programmatic dependent launches on by default (session 16: batch 64 5.7-6.0 % faster
# in the same run; the TRL test and the full table not yet run with them). (1) the TRL GRPO GPU
# test through the static loop (dependent launches now on); (2) the full batch-64 table: HF eager,
# static cache, defaults, dependent launches off, sync_every=1, defaults again; (3) one traced warm
# call at the defaults (where a step's time goes now; kernels_overlapping counts dependent starts).
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-585}
gpu_pytest "runtime static_loop gpu test" 120 runtime_test.log tests/gpu/test_runtime_gpu.py -k static_loop
BENCH_BATCHES=64 BENCH_CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_no_pdl,hf_zero3_graphs_sync1,hf_zero3_graphs \
  timeout 300 python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
mv $OUT/decode.json $OUT/decode64.json 2>/dev/null; rm -f $OUT/decode_partial.jsonl
grep -A9 "^| batch" $OUT/bench64.log | cut -c1-330; grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
left=$((LIMIT - SECONDS - 5))
PROFILE_TIMELINE=1 BENCH_BATCHES=64 timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/timeline.log 2>&1; echo "timeline rc=$? at ${SECONDS}s"
python3 benchmarks/gpu_calls/decode_rows.py --timeline
