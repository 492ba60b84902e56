import os

import pytest
import torch

# Compiling for Hopper works without a GPU; keep CPU-only machines on sm_90a.
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    skip = pytest.mark.skip(reason="needs a CUDA GPU with compute capability >= 9.0")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
