#!/bin/bash
# (Record of a call as run. Since session 16's last commits HF_ZERO3_PDL is on by default without prefetch: the
# "pdl_no_prefetch" rows are today's hf_zero3_graphs, hf_zero3_graphs_no_pdl the old defaults.)
# Session 16, call 3 (#14): calls 1 and 2 measured HF_ZERO3_PDL=1 only, the plain decode path
# having fallen back (inductor embeds a triton_op kernel's source in a string literal: the prefetch's
# inline-asm newline escape broke it; fixed). (1) dependent-launch GPU tests (16-layer GEMM stack
# in one CUDA graph, plain vs dependent, us per replay); (2) the compiled-decode GPU test at the
# defaults (the kernels' new PDL/PREFETCH parameters); (3) the decode bench at batch 64: static
# cache, defaults and HF_ZERO3_PDL=1 without prefetch, twice each, same run.
# Run as `CALL_LIMIT=570 bash benchmarks/gpu_calls/session16_call3.sh` (carry .whl).
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-570}
timeout 110 python3 -m pytest -q -s -m gpu tests/gpu/test_dependent_launch_gpu.py > $OUT/pdl_test.log 2>&1; echo "dependent launch gpu tests rc=$? at ${SECONDS}s"
tail -1 $OUT/pdl_test.log | cut -c1-300; grep -m12 "^E  \|us per replay\|Error" $OUT/pdl_test.log | cut -c1-400
timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:\|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-500
left=$((LIMIT - SECONDS - 5))
BENCH_BATCHES=64 BENCH_CONFIGS=hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_pdl_no_prefetch,hf_zero3_graphs,hf_zero3_graphs_pdl_no_prefetch \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
python3 benchmarks/gpu_calls/decode_rows.py
