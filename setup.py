"""Package metadata lives in pyproject.toml. This file only adds the optional prebuilt native gate:

    HF_ZERO3_BUILD_EXT=1 pip install --no-build-isolation .

compiles csrc/gate.cpp into hf_zero3.native_gate_ext against the installed (CUDA) torch. Without the
variable nothing is compiled at install time; the gate is JIT-built from csrc/ on first use.
"""

import importlib.util
import os
import sys

from setuptools import setup


def _switch(name: str) -> bool:
    """``name``'s value by hf_zero3's one switch grammar (``hf_zero3/options.py``, read from its
    file: the package is not importable before it is installed); unset is off."""
    spec = importlib.util.spec_from_file_location(
        "_hf_zero3_options", os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_zero3", "options.py")
    )
    options = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(options)
    raw = os.environ.get(name, "")
    return bool(raw.strip()) and options.parse_switch(name, raw)


ext_modules, cmdclass = [], {}
if _switch("HF_ZERO3_BUILD_EXT"):
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    ext_modules = [
        CUDAExtension(
            "hf_zero3.native_gate_ext",
            ["csrc/gate.cpp"],
            extra_compile_args={"cxx": ["-O2", "-DHF_ZERO3_WITH_CUDA"]},
        )
    ]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
