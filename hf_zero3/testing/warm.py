"""Build DeepSpeed's CPU shared-memory comm op once, in one process, before ranks start.

Every DeepSpeed comm init JIT-builds it (~35 s cold). Two ranks building it at once under a test
timeout can be killed mid-build, leaving torch's build lock behind, after which every later build
waits forever. ``python -m hf_zero3.testing.warm`` builds it up front (seconds when cached) and
clears a lock that no build holds.
"""

from __future__ import annotations

import glob
import os


def warm_cpu_comm_op() -> str:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    from torch.utils.cpp_extension import _get_build_directory

    builder = ShareMemCommBuilder()
    build_dir = _get_build_directory(builder.name, verbose=False)
    lock = os.path.join(build_dir, "lock")
    if os.path.exists(lock) and not glob.glob(os.path.join(build_dir, "*.so")):
        os.remove(lock)  # left by a build that was killed; we are the only builder now
    builder.load(verbose=False)
    return build_dir


if __name__ == "__main__":
    print(f"DeepSpeed CPU comm op ready in {warm_cpu_comm_op()}")
