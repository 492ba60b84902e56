import pytest
import torch

import quack_kernels  # noqa: F401  (without a GPU it makes the DSL compile for sm_90a)


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    skip = pytest.mark.skip(reason="needs a CUDA GPU with compute capability >= 9.0")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
