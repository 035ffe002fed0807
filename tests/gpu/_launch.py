"""How the GPU tests start ranks: one per visible GPU (up to two), NCCL, DeepSpeed's comm layer,
under the harness's hard timeout and a short process-group timeout. The harness pins each rank
to its GPU before the rank's function runs."""

import torch

from hf_zero3.testing import run_ranks


def world() -> int:
    return max(1, min(2, torch.cuda.device_count()))


def run(fn, *args, timeout=420, **kwargs):
    return run_ranks(
        fn, world(), args=args, kwargs=kwargs, backend="nccl", init="deepspeed", timeout=timeout, pg_timeout=120
    )
