import os
import sys

import pytest

# Let spawned ranks import test modules, the fixtures package and hf_zero3 from a source checkout.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch always installed by make
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-test` on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))


def pytest_sessionstart(session):
    """Build DeepSpeed's CPU comm op once, before any rank is spawned (see fixtures/warm.py).

    Under pytest-xdist the controller builds it before it starts the workers; a worker must not
    (it would take a build another worker is running for a stale one)."""
    import torch

    if torch.cuda.is_available() or hasattr(session.config, "workerinput"):
        return
    from fixtures.warm import warm_cpu_comm_op

    warm_cpu_comm_op()
