#!/bin/bash
# session 12 call 1 (1x H200): #14 — the prompt's forward compiled (prompt length dynamic), the
# greedy tail (argmax, EOS masking, token bookkeeping) compiled, the loop lookup overlapping the
# prefill; and session 11's kernel refactor (304656a, b2298a9), never run on a GPU: the kernel and
# compiled-decode GPU tests, then the decode benchmark (ours, ours with the prompt's forward eager)
# at batch 64 and 8, then the batch-64 profile.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 80 python3 -m pytest -q -m gpu tests/gpu/test_gqa_decode_kernel_gpu.py > $OUT/kernel_test.log 2>&1; echo "kernel test rc=$? at ${SECONDS}s"
tail -1 $OUT/kernel_test.log | cut -c1-300; grep -m6 "^E  " $OUT/kernel_test.log | cut -c1-300
timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|^graphs:\|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-400
export BENCH_CONFIGS=hf_zero3_graphs,hf_zero3_graphs_eager_prefill
left=$((420 - SECONDS))
BENCH_BATCHES=64,8 timeout $left python3 benchmarks/generation/bench_decode.py > $OUT/bench_decode.log 2>&1; echo "decode rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode.json $OUT/ 2>/dev/null; cp $OUT/decode_partial.jsonl $OUT/partial.jsonl 2>/dev/null
grep "^measured" $OUT/bench_decode.log | cut -c1-900
grep -m5 "Error\|error:\|hf_zero3 lockstep" $OUT/bench_decode.log | cut -c1-400
left=$((590 - SECONDS))
if [ $left -gt 80 ]; then
  PROFILE_MODES=default BENCH_BATCHES=64 timeout $left python3 benchmarks/generation/profile_decode.py > $OUT/profile.log 2>&1; echo "profile rc=$? at ${SECONDS}s"
  cp benchmarks/generation/profile_decode.json $OUT/ 2>/dev/null
  python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/profile.log") if l.startswith("{")]
for r in rows:
    top = r.pop("top", None)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k not in ("calls",)})
    if top and r["what"] in ("kernels", "prefill_kernels", "host_profile"):
        for t in top[:24]:
            print("   ", str(t[0] if isinstance(t, list) else t)[:110], t[1:] if isinstance(t, list) else "")
PY
else echo "profile not run: ${left}s left"; fi
