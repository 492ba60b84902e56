import os

import pytest
import torch

# The compile and report tests build sm_90a code; on a GPU older than Hopper too (the
# package targets the current GPU where there is one, and the GPU tests skip there).
if "CUTE_DSL_ARCH" not in os.environ and torch.cuda.is_available() \
        and torch.cuda.get_device_capability() < (9, 0):
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"

import quack_kernels  # noqa: E402, F401  (without a GPU it makes the DSL compile for sm_90a)


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    skip = pytest.mark.skip(reason="needs a CUDA GPU with compute capability >= 9.0")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _surface_async_cuda_errors(request):
    """Synchronize after every GPU test: an asynchronous CUDA error (a kernel fault) is
    then reported at the teardown of the test that launched it, not at the first
    synchronization of a later test in the same process."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        torch.cuda.synchronize()


@pytest.fixture
def cuobjdump() -> str:
    """cuobjdump's path, which the resource checks read cubins with: a dev dependency
    (pyproject's ``dev`` extra), so its absence fails them instead of skipping them
    silently."""
    from quack_kernels.report import find_cuobjdump

    path = find_cuobjdump()
    if path is None:
        pytest.fail("cuobjdump not found: install the dev extra (nvidia-cuda-cuobjdump)")
    return path
