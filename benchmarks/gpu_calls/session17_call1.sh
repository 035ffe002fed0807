#!/bin/bash
# Session 17, call 1 (#14): the rope attention kernel's loop without a branch between blocks (its
# mask, key and value loads in flight together, the loop software-pipelined, bounded by the fill
# count). (1) the attention probe, this kernel against session 16's (ATTENTION_PROBE_BASELINE, a
# copy of 59b059a's gqa_decode.py carried in .probe/) at the same settings, same run; (2) the
# kernel GPU tests; (3) batch 64: static cache, defaults twice; (4) one traced call at the defaults.
# Run as `CALL_LIMIT=585 bash benchmarks/gpu_calls/session17_call1.sh` (carry .whl, .probe), after
# `mkdir -p .probe && git show 59b059a:hf_zero3/kernels/gqa_decode.py > .probe/gqa_decode_session16.py`
# (.probe/ is not in the repository).
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-585}
ATTENTION_PROBE_BASELINE=$PWD/.probe/gqa_decode_session16.py timeout 150 python3 benchmarks/generation/attention_probe.py > $OUT/probe.log 2>&1; echo "attention probe rc=$? at ${SECONDS}s"
grep -A40 "^| batch" $OUT/probe.log | cut -c1-200; grep -m5 "Error" $OUT/probe.log | cut -c1-300
gpu_pytest "kernel gpu tests" 120 kernel_test.log tests/gpu/test_gqa_decode_kernel_gpu.py
BENCH_BATCHES=64 BENCH_CONFIGS=hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs \
  timeout 240 python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
python3 benchmarks/gpu_calls/decode_rows.py
left=$((LIMIT - SECONDS - 5))
PROFILE_TIMELINE=1 BENCH_BATCHES=64 timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/timeline.log 2>&1; echo "timeline rc=$? at ${SECONDS}s"
python3 benchmarks/gpu_calls/decode_rows.py --timeline
