#!/bin/bash
# session 12 call 4 (1x H200, the session's last device minutes): where a batch-64 step's time goes
# after call 3 (split-K down/o_proj, compiled greedy tail, compiled prefill): profile_decode,
# default mode only, for the next session's work toward issue #14's 40 %.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
PROFILE_MODES=default BENCH_BATCHES=64 timeout 420 python3 benchmarks/generation/profile_decode.py > $OUT/profile.log 2>&1; echo "profile rc=$? at ${SECONDS}s"
cp benchmarks/generation/profile_decode.json $OUT/ 2>/dev/null
python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/profile.log") if l.startswith("{")]
for r in rows:
    top = r.pop("top", None)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k not in ("calls",)})
    if top and r["what"] in ("kernels", "prefill_kernels"):
        for t in top[:28]:
            print("   ", str(t[0])[:100], t[1:])
PY
grep -m3 "Error" $OUT/profile.log | cut -c1-300
