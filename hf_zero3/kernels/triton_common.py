"""Triton functions more than one kernel module calls (imported only where Triton is).

A kernel module imports them by their own names: inside ``torch.compile`` inductor re-emits a
``triton_op`` kernel with the Triton functions it finds under those names in the kernel's module
globals."""

import triton
import triton.language as tl


@triton.jit
def dependent_start(PDL: tl.constexpr):
    """A programmatic dependent launch's start (nothing without ``PDL``): wait for the kernel
    before, release the one after."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
