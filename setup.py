"""Package metadata lives in pyproject.toml. This file only adds the optional prebuilt native gate:

    HF_ZERO3_BUILD_EXT=1 pip install --no-build-isolation .

compiles csrc/gate.cpp into hf_zero3._gate against the installed (CUDA) torch. Without the
variable nothing is compiled at install time; the gate is JIT-built from csrc/ on first use.
"""

import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("HF_ZERO3_BUILD_EXT") == "1":
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    ext_modules = [
        CUDAExtension("hf_zero3._gate", ["csrc/gate.cpp"], extra_compile_args={"cxx": ["-O2", "-DHF_ZERO3_WITH_CUDA"]})
    ]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
