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
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "_compile_kernels_for_gpu.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    assert len(result) == 23, result
    failed = {k: v for k, v in result.items() if v != "ok"}
    assert not failed, failed


_EMBED = r"""
import ast, json, sys
sys.path.insert(0, sys.argv[1])
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code as closure
from hf_zero3.kernels import decode_gemm_triton as gemm
from hf_zero3.kernels import gqa_decode
assert gqa_decode.load() is not None, gqa_decode.unavailable_reason()
Q = chr(39) * 3
out = {}
for kernel in [gemm.linear_kernel, gemm.gate_up_kernel, gemm.linear_split_kernel, *gqa_decode._state["jit"].values()]:
    src = closure(kernel)
    try:
        assert Q not in src, "a triple quote in the source"
        embedded = ast.literal_eval(Q + src + Q)  # what the generated module's string holds
        ast.parse("import triton" + chr(10) + "import triton.language as tl" + chr(10) + embedded)
        out[kernel.__name__] = "ok"
    except (SyntaxError, ValueError, AssertionError) as exc:
        out[kernel.__name__] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_kernel_sources_survive_inductors_embedding():
    """Inside ``torch.compile`` inductor re-emits a ``triton_op`` kernel's source with the Triton
    functions it calls, embedded in a triple-quoted string literal of the generated module, which
    must then import. An escape anywhere in that source (a backslash-n in an inline-asm string, even
    in a comment) becomes the character itself: on the GPU the generated module did not import and
    the decode step would fall back to transformers' loop. The embedding is done here as
    inductor's generated code does it, for every kernel, with the real compiler's kernel objects
    (the interpreter's have no source)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(HERE))
    proc = subprocess.run([sys.executable, "-c", _EMBED, root], env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 5 and all(v == "ok" for v in result.values()), result
