#!/bin/bash
# Session 18, call 2 (#14). Run as `CALL_LIMIT=560 bash benchmarks/gpu_calls/session18_call2.sh`
# (carry .whl and .probe). Call 1 found the rope kernel's early-loading order 11 % faster at 2 warps
# with dependent launches but slower in plain launches; now the order is a dependent launch's only
# and dependent launches take 2 warps where 4 would need two waves. (1) kernel and dependent-launch
# GPU tests; (2) the probe against session 17's kernel; (3) the host side of a warm batch-64 call
# (cProfile, the prompt forward's host ops: call 1's stamps put it at 23 ms of host time against
# ~15 ms on the GPU); (4) batch 64 at the defaults three times beside the static cache; (5) the
# compiled-decode GPU test.
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-560}
gpu_pytest "kernel gpu tests" 100 kernel_test.log tests/gpu/test_gqa_decode_kernel_gpu.py
gpu_pytest "dependent launch gpu tests" 150 pdl_test.log tests/gpu/test_dependent_launch_gpu.py
ATTENTION_PROBE_BASELINE=.probe/gqa_decode_session17.py timeout 100 python3 benchmarks/generation/attention_probe.py > $OUT/probe.log 2>&1; echo "probe rc=$? at ${SECONDS}s"
PROFILE_HOST=1 BENCH_BATCHES=64 timeout 120 python3 benchmarks/generation/profile_decode.py > $OUT/host.log 2>&1; echo "host profile rc=$? at ${SECONDS}s"
left=$((LIMIT - SECONDS - 90))
BENCH_BATCHES=64 BENCH_CONFIGS=hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs,hf_zero3_graphs \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
python3 benchmarks/gpu_calls/decode_rows.py
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
left=$((LIMIT - SECONDS - 3))
gpu_pytest "compiled decode gpu test" $left decode_test.log tests/gpu/test_compiled_decode_gpu.py
