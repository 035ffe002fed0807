"""The decode GEMMs' autotuner on a GPU (marked gpu): a new shape's launch configurations are all
compiled before the first is timed (:func:`hf_zero3.kernels.triton_launch.compile_before_timing`), the
timing then finds each in the kernel's cache, and the tuned product is the matmul's."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _compiled(kernel) -> int:
    """Compiled variants in ``kernel``'s cache for the current GPU (Triton's own bookkeeping)."""
    caches = kernel.device_caches[torch.cuda.current_device()]
    return len(caches[0])


def test_a_new_shape_compiles_every_configuration_before_timing_the_first(tmp_path, monkeypatch):
    from hf_zero3.kernels import decode_gemm

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # no cached kernels or timings

    assert decode_gemm.load() is not None, decode_gemm._state.get("error")
    gate_up, split = decode_gemm._state["tuned"]
    timed_with = []  # compiled variants of the kernel as each configuration's timing begins
    bench = split._bench

    def counting(*args, config, **meta):
        timed_with.append(_compiled(split.fn))
        return bench(*args, config=config, **meta)

    split._bench = counting  # the hook's own _bench, wrapped: it compiles on the first timing
    try:
        x = torch.randn(48, 3072, device="cuda", dtype=torch.bfloat16)  # a shape no other test tunes
        w = torch.randn(1536, 3072, device="cuda", dtype=torch.bfloat16)
        before = _compiled(split.fn)
        parts = decode_gemm._call_split(split, x, w, 4, {}, decode_gemm._DEPENDENT)  # as the decode step
    finally:
        split._bench = bench
    configs = [c for c in split.configs if 3072 % (4 * c.kwargs["BLOCK_K"]) == 0]  # as _split_prune keeps
    if not timed_with:
        pytest.fail("the autotuner timed nothing: a cached choice for this shape (a shared TRITON_CACHE_DIR?)")
    assert len(timed_with) == len(configs) > 1
    # nothing compiled before the first timing; that timing compiled every configuration (later
    # timings found each compiled: none compiled again)
    assert timed_with[0] == before, (before, timed_with)
    assert timed_with[1:] == [before + len(configs)] * (len(configs) - 1), (before, timed_with)
    torch.testing.assert_close(parts.sum(0), x.float() @ w.float().T, rtol=2e-2, atol=2e-1)
