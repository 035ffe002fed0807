# Sourced first by a GPU call script: DeepSpeed and TRL from the carried wheelhouse (.whl, built by
# ../shared/gpu/make-wheelhouse.sh) into /tmp/site, and the environment every call runs under
# (sm_90 builds, NVLink multicast off, unbuffered output, extensions built under /tmp).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/ext
