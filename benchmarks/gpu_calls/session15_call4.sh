#!/bin/bash
# Session 15, call 4 (#14): after the host-side trims (module-state key, DeepSpeed hook suspension,
# the attention-sinks check): the decode table at batch 64 (defaults twice, host drift) and the
# host side of one warm batch-64 call under cProfile (where a call's ~19 ms of GPU idle time
# outside the decode steps goes). Run as `CALL_LIMIT=290 bash benchmarks/gpu_calls/session15_call4.sh`.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
LIMIT=${CALL_LIMIT:-290}
BENCH_BATCHES=64 BENCH_CONFIGS=hf_static_gathered,hf_zero3_graphs,hf_zero3_graphs timeout 150 python3 benchmarks/generation/bench_decode.py > $OUT/bench64.log 2>&1; echo "decode batch 64 rc=$? at ${SECONDS}s"
rm -f $OUT/decode_partial.jsonl
grep -A6 "^| batch" $OUT/bench64.log | cut -c1-330; grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench64.log | cut -c1-400
left=$((LIMIT - SECONDS - 3))
PROFILE_HOST=1 BENCH_BATCHES=64 timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/host.log 2>&1; echo "host profile rc=$? at ${SECONDS}s"
grep -m4 '"warmup"' $OUT/host.log | cut -c1-200
