import os

import pytest
import torch

# On a CPU-only host the CPU tests run Triton kernels (hf_zero3.kernels) under Triton's
# interpreter. Triton reads the switch when it is imported, so it is set before any test module
# (or DeepSpeed, which imports Triton when it is there) is collected; a GPU host keeps compiled
# Triton for its GPU tests.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Modules whose multi-rank fixtures compile on CPU for minutes, longest first. pytest-xdist
# (`make test`: two workers, one module at a time each, `--no-loadscope-reorder`) starts them
# first, so the two workers finish together instead of one running a long module alone at the end.
LONG_MODULES_FIRST = (
    "test_static_loop.py",
    "test_trl.py",
    "test_compiled_decode.py",
    "test_lockstep_generation.py",
    "test_compiled_batch_sizes.py",
    "test_compiled_buckets.py",
    "test_trl_fast_rollouts.py",
    "test_agree_or_raise.py",
)


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LONG_MODULES_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: a module keeps its order


@pytest.fixture
def newer_transformers(monkeypatch):
    """Call it to make the installed metadata say transformers 5.99.0: newer than every release set
    CI runs (``hf_zero3._upstream.versions``); undone with the test's monkeypatch."""
    from hf_zero3._upstream import versions

    def newer(release: str = "5.99.0") -> None:
        real = versions.installed
        monkeypatch.setattr(versions, "installed", lambda pkg: release if pkg == "transformers" else real(pkg))

    return newer
