"""What a CPU rank imports before it runs anything: loaded once in the fork server of
:func:`hf_zero3.testing.run_ranks`, so each rank starts as a fork of a process that already holds
torch, DeepSpeed, transformers, accelerate, PEFT and TRL.

Importing them costs a fresh interpreter about ten seconds of CPU; a test suite that starts two
ranks per test would otherwise pay that for every test. Nothing here runs an op, leaves a thread
or a child process running, or touches CUDA: the fork server must stay safe to fork. Optional
libraries that are not installed are skipped.
"""

from __future__ import annotations

import importlib
import os

# Chosen before DeepSpeed is imported: it picks its accelerator once.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

MODULES = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._inductor.compile_fx",  # what the first torch.compile of a rank imports: seconds
    "torch.fx",
    "deepspeed",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.partition_parameters",
    "transformers",
    "transformers.trainer",
    "transformers.generation.utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.t5.modeling_t5",
    "accelerate",
    "peft",
    "trl",
    "trl.trainer.grpo_trainer",
    "hf_zero3",
    "hf_zero3.generation",
    "hf_zero3.trainer",
    "hf_zero3.trl",
    "hf_zero3.compile",
)

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except ImportError:  # an optional library (TRL, PEFT) that this environment lacks
        pass

# Inductor probes the CPU's vector ISA by building and running test programs, once per process
# (an lru_cache): probed here, every forked rank that compiles inherits the answer.
try:
    from hf_zero3._upstream.torch import probe_cpu_vec_isa

    probe_cpu_vec_isa()
except Exception:  # no C++ toolchain: each rank finds out for itself, as it would unforked
    pass
