#!/bin/bash
# Prepared in session 15 for the next session, NOT RUN (device time spent). Run as
# `CALL_LIMIT=585 bash benchmarks/gpu_calls/session15_prepared_prefill.sh` (carry .whl).
# #14, batch 64: the compiled prompt forward is host-bound on 1xH200 (~24 ms of host time, 191
# Triton launches from Python, 34 aten::copy_ taking 8 ms of host time under cProfile, ~15 ms of
# GPU time), so the GPU waits on it and the loop lookup after it. (1) One warm call's host side and
# the prompt forward's host ops with their shapes (which copies, from where); (2) the compiled-decode
# GPU test with HF_ZERO3_PREFILL_CPP_WRAPPER=1 (inductor's C++ wrapper for the prompt forward);
# (3) the decode bench at batch 64 with and without it, each row twice. If the C++-wrapper rows are
# faster and the test passes, consider it on by default (its first compile is longer).
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-590}
PROFILE_HOST=1 BENCH_BATCHES=64 timeout 120 python3 benchmarks/generation/profile_decode.py > $OUT/host.log 2>&1; echo "host profile rc=$? at ${SECONDS}s"
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/host.log"):
    if l.startswith("{") and '"prefill_host_ops"' in l:
        r = json.loads(l)
        print("prefill host ms", r["host_ms"])
        for t in r["top"][:15]:
            print("   ", t)
        for c in r["copies"][:12]:
            print("  copy", c)
PY
HF_ZERO3_PREFILL_CPP_WRAPPER=1 timeout 180 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test (cpp prefill) rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:\|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-500
left=$((LIMIT - SECONDS - 5))
BENCH_BATCHES=64 BENCH_CONFIGS=hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_cpp_prefill,hf_zero3_graphs,hf_zero3_graphs_cpp_prefill \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
rm -f $OUT/decode_partial.jsonl
grep -A8 "^| batch" $OUT/bench64.log | cut -c1-330; grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
