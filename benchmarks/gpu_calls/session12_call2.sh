#!/bin/bash
# session 12 call 2 (1x H200): #14 — the compiled-decode GPU test again (call 1: a prompt sliced
# from a wider tensor recompiled the prompt's forward; now made contiguous), the decode-GEMM probe
# with split-K rows (o_proj, down, q/k/v: cuBLAS reaches 1.4-2.4 TB/s there), and the batch-64
# profile of the new loop (compiled prefill, compiled greedy tail).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
timeout 150 python3 -m pytest -q -s -m gpu tests/gpu/test_compiled_decode_gpu.py > $OUT/gpu_test.log 2>&1; echo "compiled decode gpu test rc=$? at ${SECONDS}s"
tail -1 $OUT/gpu_test.log | cut -c1-300; grep -m8 "^E  \|hf_zero3 lockstep" $OUT/gpu_test.log | cut -c1-400
timeout 150 python3 benchmarks/generation/decode_gemm_probe.py > $OUT/probe.log 2>&1; echo "probe rc=$? at ${SECONDS}s"
cp benchmarks/generation/decode_gemm_probe.json $OUT/ 2>/dev/null
grep -A20 "^| shape" $OUT/probe.log | cut -c1-300; grep -m3 "Error" $OUT/probe.log | cut -c1-300
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
        for t in top[:26]:
            print("   ", str(t[0] if isinstance(t, list) else t)[:110], t[1:] if isinstance(t, list) else "")
PY
  grep -m3 "Error" $OUT/profile.log | cut -c1-300
else echo "profile not run: ${left}s left"; fi
