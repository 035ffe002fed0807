#!/bin/bash
# (Record of a call as run. Since session 16's last commits HF_ZERO3_PDL is on by default without prefetch: the
# "pdl_no_prefetch" rows are today's hf_zero3_graphs, hf_zero3_graphs_no_pdl the old defaults.)
# Session 16, call 1 (#14, batch 64 at 37 % of the floor, 40 % asked): the decode kernels as
# programmatic dependent launches (HF_ZERO3_PDL=1: the Triton GEMMs prefetch their weight slice to
# L2 and wait for their input after; the rope attention and inductor's kernels dependent too).
# (1) what this torch/Triton offer; (2) the dependent-launch GPU tests (a 16-layer GEMM stack in a
# CUDA graph, plain vs dependent, timings printed); (3) the decode bench at batch 64: defaults vs
# HF_ZERO3_PDL=1 at prefetch 256 (default), 0 and 1024, defaults and PDL again (drift). Run as
# `CALL_LIMIT=570 bash benchmarks/gpu_calls/session16_call1.sh` (carry .whl).
. benchmarks/gpu_calls/_preamble.sh
LIMIT=${CALL_LIMIT:-570}
python3 -c "
import torch, triton, torch._inductor.config as c, triton.language.extra.cuda as x
print('torch', torch.__version__, 'triton', triton.__version__, 'inductor enable_pdl', getattr(c.triton, 'enable_pdl', 'absent'), 'gdc_wait', hasattr(x, 'gdc_wait'), torch.cuda.get_device_name())"
timeout 200 python3 -m pytest -q -s -m gpu tests/gpu/test_dependent_launch_gpu.py > $OUT/pdl_test.log 2>&1; echo "dependent launch gpu tests rc=$? at ${SECONDS}s"
tail -1 $OUT/pdl_test.log | cut -c1-300; grep -m12 "^E  \|us per replay\|Error" $OUT/pdl_test.log | cut -c1-400
left=$((LIMIT - SECONDS - 8))
BENCH_BATCHES=64 BENCH_CONFIGS=hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs_pdl,hf_zero3_graphs_pdl_no_prefetch,hf_zero3_graphs_pdl_prefetch1k,hf_zero3_graphs,hf_zero3_graphs_pdl \
  timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
grep -A10 "^| batch" $OUT/bench64.log | cut -c1-330; grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
python3 benchmarks/gpu_calls/decode_rows.py
