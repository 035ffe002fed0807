"""hf_zero3's Triton kernels through Triton's real compiler for an H100/H200 (sm_90) target, on a
CPU host: the interpreter the other CPU kernel tests run accepts code the compiler rejects (types,
layouts), so every kernel is also compiled ahead of time to PTX and a cubin. No GPU is needed;
without Triton's NVIDIA backend the test is skipped and says why."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the kernel tests need Triton (installed with the test extra)")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(300)
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real compiler
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_compile_kernels_for_gpu.py")], env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    assert len(result) == 19, result
    failed = {k: v for k, v in result.items() if v != "ok"}
    assert not failed, failed
