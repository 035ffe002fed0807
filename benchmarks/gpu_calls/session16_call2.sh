#!/bin/bash
# (Record of a call as run. Since session 16's last commits HF_ZERO3_PDL is on by default without prefetch: the
# "pdl_no_prefetch" rows are today's hf_zero3_graphs, hf_zero3_graphs_no_pdl the old defaults.)
# Session 16, call 2 (#14): call 1 ran the PDL rows only (the plain launches had broken: a
# triton_op kernel's launch must pass every parameter, defaults are not taken; fixed). (1) the
# dependent-launch GPU tests (16-layer GEMM stack in one CUDA graph, plain vs dependent, us per
# replay printed); (2) decode bench at batch 64, defaults vs HF_ZERO3_PDL=1 without prefetch (call
# 1's best), twice each, same run; (3) one traced warm call with HF_ZERO3_PDL=1 (do kernels
# overlap in the graphs?). Run as `CALL_LIMIT=570 bash benchmarks/gpu_calls/session16_call2.sh`.
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-570}
timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_dependent_launch_gpu.py > $OUT/pdl_test.log 2>&1; echo "dependent launch gpu tests rc=$? at ${SECONDS}s"
tail -1 $OUT/pdl_test.log | cut -c1-300; grep -m12 "^E  \|us per replay\|Error" $OUT/pdl_test.log | cut -c1-400
BENCH_BATCHES=64 BENCH_CONFIGS=hf_zero3_graphs,hf_zero3_graphs_pdl_no_prefetch,hf_zero3_graphs,hf_zero3_graphs_pdl_no_prefetch \
  timeout 270 python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
python3 benchmarks/gpu_calls/decode_rows.py
left=$((LIMIT - SECONDS - 5))
PROFILE_TIMELINE=1 BENCH_BATCHES=64 PROFILE_VARIANTS="pdl,HF_ZERO3_PDL=1,HF_ZERO3_PDL_PREFETCH=0" timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/timeline.log 2>&1; echo "timeline rc=$? at ${SECONDS}s"
python3 benchmarks/gpu_calls/decode_rows.py --timeline
