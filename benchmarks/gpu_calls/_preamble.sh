# Sourced first by a GPU call script: DeepSpeed and TRL from the carried wheelhouse (.whl, built by
# ../shared/gpu/make-wheelhouse.sh) into /tmp/site, and the environment every call runs under
# (sm_90 builds, NVLink multicast off, unbuffered output, extensions built under /tmp).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext

# gpu_pytest LABEL SECONDS LOG PYTEST-ARGS...: the marked-gpu tests under a time limit, output to
# $OUT/LOG; prints the exit code, pytest's summary line and the lines worth reading (failures,
# timings the tests print, the compiled loop's stats, lockstep's log lines)
gpu_pytest() {
  local label=$1 limit=$2 log=$3
  shift 3
  timeout "$limit" python3 -m pytest -q -s -m gpu "$@" > "$OUT/$log" 2>&1; echo "$label rc=$? at ${SECONDS}s"
  tail -1 "$OUT/$log" | cut -c1-300
  grep -m12 "^E  \|us per replay\|max abs diff\|Error\|^graphs:\|rope_attention\|hf_zero3 lockstep" "$OUT/$log" | cut -c1-600
}
