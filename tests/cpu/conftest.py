import os

import torch

# On a CPU-only host the CPU tests run Triton kernels (hf_zero3.kernels) under Triton's
# interpreter. Triton reads the switch when it is imported, so it is set before any test module
# (or DeepSpeed, which imports Triton when it is there) is collected; a GPU host keeps compiled
# Triton for its GPU tests.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
