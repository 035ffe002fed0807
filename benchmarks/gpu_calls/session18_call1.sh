#!/bin/bash
# Session 18, call 1 (#14, batch 64 at 35.7-39.8 % of the floor, 40 % asked). Run as
# `CALL_LIMIT=580 bash benchmarks/gpu_calls/session18_call1.sh` (carry .whl and .probe: session
# 17's kernel module as the probe's baseline). (1) kernel GPU tests with the rope kernel that loads
# its first cache block before the dependent wait; (2) attention probe, that kernel against session
# 17's, plain and dependent launches; (3) untraced phase stamps of warm batch-64 calls, the
# parameters released early (default) and late; (4) batch 64: defaults, late release, C++-wrapper
# prefill, defaults again; (5) the compiled-decode GPU test (graphs replayed on a second call).
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-580}
gpu_pytest "kernel gpu tests" 120 kernel_test.log tests/gpu/test_gqa_decode_kernel_gpu.py
ATTENTION_PROBE_BASELINE=.probe/gqa_decode_session17.py timeout 120 python3 benchmarks/generation/attention_probe.py > $OUT/probe.log 2>&1; echo "probe rc=$? at ${SECONDS}s"
grep -A40 "^batch" $OUT/probe.log | grep -v "^-" | cut -c1-160 | head -40
PROFILE_EVENTS=1 PROFILE_EVENT_CALLS=2 BENCH_BATCHES=64 PROFILE_VARIANTS="early;late:HF_ZERO3_RELEASE_EARLY=0" \
  timeout 150 python3 benchmarks/generation/profile_decode.py > $OUT/events.log 2>&1; echo "events rc=$? at ${SECONDS}s"
python3 benchmarks/gpu_calls/decode_rows.py --events | cut -c1-1500
left=$((LIMIT - SECONDS - 150))
BENCH_BATCHES=64 BENCH_CONFIGS=hf_zero3_graphs,hf_zero3_graphs_late_release,hf_zero3_graphs_cpp_prefill,hf_zero3_graphs,hf_zero3_graphs_late_release \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
python3 benchmarks/gpu_calls/decode_rows.py
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
left=$((LIMIT - SECONDS - 3))
gpu_pytest "compiled decode gpu test" $left decode_test.log tests/gpu/test_compiled_decode_gpu.py
