"""Every ``HF_ZERO3_*`` environment variable hf_zero3 reads, named in one registry.

The memory plan's variables, one per field of :class:`~hf_zero3.compile.MemoryPlanConfig`
(``HF_ZERO3_<FIELD>``), come from its dataclass; :data:`ENVIRONMENT` holds all the others. The
memory plan's typo check accepts exactly these two sets, so a documented variable set for one
part of the package never makes another part refuse to start. A test holds this registry, the
names the code reads and the documentation's table to the same list.
"""

from __future__ import annotations

__all__ = ["DECODE_SWITCHES", "ENVIRONMENT"]

#: The fast decode path's switches (read when a lockstep call builds or looks up its loop).
DECODE_SWITCHES: dict[str, str] = {
    "HF_ZERO3_FUSE_QKV": "q/k/v projections of a decode step as one GEMM (on)",
    "HF_ZERO3_TRITON_MLP": "SiLU MLPs through the Triton gate/up GEMM (on)",
    "HF_ZERO3_SPLIT_K": "down_proj and o_proj through the split-K Triton GEMM (on)",
    "HF_ZERO3_TRITON_ATTENTION": "the Triton GQA decode-attention kernel: auto, always or 0 (auto)",
    "HF_ZERO3_FUSE_ROPE": "rotary embedding and cache write inside the attention kernel (on)",
    "HF_ZERO3_TRITON_QKV": "fused q/k/v as split-K partials summed in the rope kernel (on)",
    "HF_ZERO3_PDL": "decode kernels as programmatic dependent launches where the GPU can (on)",
    "HF_ZERO3_COMPILE_PREFILL": "the static loop compiles the prompt's forward (on)",
}

#: Every variable besides the memory plan's per-field ones.
ENVIRONMENT: dict[str, str] = {
    "HF_ZERO3_AGREE_TIMEOUT": "seconds an agreement waits for a rank that never arrives",
    "HF_ZERO3_PLAN_DUMP": "a directory where rank 0 writes the memory plan's profiles and plans",
    "HF_ZERO3_NATIVE": "the native prefetch gate: auto, 0 (PyTorch fallback) or cpu",
    "HF_ZERO3_BUILD_EXT": "setup.py: 1 compiles the native gate at install time",
    "HF_ZERO3_PG_TIMEOUT": "set by hf_zero3.testing.run_ranks in each rank (its process-group timeout)",
    **DECODE_SWITCHES,
}
