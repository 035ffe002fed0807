#!/bin/bash
# Session 18, call 3 (#14). Run as `CALL_LIMIT=540 bash benchmarks/gpu_calls/session18_call3.sh`
# (carry .whl). Call 2's host profile: the prompt forward's host time was 16 blocking copies (one a
# layer, ~0.45 ms each: transformers' StaticLayer moves its CPU fill count to the GPU inside the
# forward); now the counters are made on the GPU first. (1) dependent-launch GPU tests (the rope
# test now allows bf16 rounding between 2- and 4-warp launches); (2) untraced phase stamps of warm
# batch-64 calls; (3) the decode table at batch 64 and 8 (defaults three times); (4) the
# compiled-decode GPU test.
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-540}
gpu_pytest "dependent launch gpu tests" 130 pdl_test.log tests/gpu/test_dependent_launch_gpu.py
PROFILE_EVENTS=1 PROFILE_EVENT_CALLS=2 BENCH_BATCHES=64 timeout 110 python3 benchmarks/generation/profile_decode.py > $OUT/events.log 2>&1; echo "events rc=$? at ${SECONDS}s"
python3 benchmarks/gpu_calls/decode_rows.py --events | cut -c1-1200
left=$((LIMIT - SECONDS - 80))
BENCH_BATCHES=64,8 BENCH_CONFIGS=hf_eager_gathered,hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs,hf_zero3_graphs \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
python3 benchmarks/gpu_calls/decode_rows.py
grep -A14 "^batch" $OUT/bench.log | cut -c1-200 | head -16
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench.log | cut -c1-400
left=$((LIMIT - SECONDS - 3))
gpu_pytest "compiled decode gpu test" $left decode_test.log tests/gpu/test_compiled_decode_gpu.py
