"""Clusters a GPU runs at once, asked of the driver.

A kernel that loops over row blocks launches a fixed grid and must not launch more
clusters than are resident together: one that does not fit runs as a second wave after
the whole first one, nearly doubling the kernel time. SMs alone do not bound it: a
cluster's CTAs must sit in one GPC, so of a 132-SM H200 fewer than
132 * ctas_per_sm / cluster_size clusters of 16 fit. ``cuOccupancyMaxActiveClusters``
knows the GPC layout; we ask it with the block size and shared memory of our kernel,
through an empty probe kernel (registers are the kernel's own business: a looping
kernel is compiled for the CTAs per SM its grid assumes).
"""

from __future__ import annotations

import functools
import os
import tempfile


def _checked(result):
    """cuda.bindings returns (status, *values): raise on an error, else the values."""
    from cuda.bindings import driver

    status, *values = result
    if status != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"quack_kernels: CUDA driver call failed: {status}")
    return values[0] if len(values) == 1 else values


@functools.lru_cache(maxsize=None)
def _primary_context(device_index: int):
    """torch's context on ``device_index`` (created by torch first), retained for the
    life of the process: the probe kernel is loaded into it, and a context whose last
    reference goes away is destroyed with everything loaded into it."""
    import torch
    from cuda.bindings import driver

    torch.empty(1, device=torch.device("cuda", device_index))
    _checked(driver.cuInit(0))
    return _checked(driver.cuDevicePrimaryCtxRetain(_checked(driver.cuDeviceGet(device_index))))


@functools.lru_cache(maxsize=None)
def _probe_function(device_index: int):
    """(CUlibrary, CUfunction) of an empty kernel loaded on ``device_index`` (compiled
    once; the library is kept with its function)."""
    import cutlass.cute as cute
    from cuda.bindings import driver

    @cute.kernel
    def empty():
        pass

    @cute.jit
    def launch_empty():
        empty().launch(grid=[1, 1, 1], block=[32, 1, 1])

    with tempfile.TemporaryDirectory(prefix="quack_kernels_probe_") as dump_dir:
        fn = cute.compile(launch_empty, options=f"--keep-cubin --dump-dir={dump_dir}")
        cubin = fn.__cubin__
        if not isinstance(cubin, bytes):
            with open(os.fspath(cubin), "rb") as f:
                cubin = f.read()
    library = _checked(driver.cuLibraryLoadData(cubin, None, None, 0, None, None, 0))
    (kernel,) = _checked(driver.cuLibraryEnumerateKernels(1, library))
    return library, _checked(driver.cuKernelGetFunction(kernel))


@functools.lru_cache(maxsize=None)
def resident_clusters(device_index: int, cluster_size: int, threads: int, smem_bytes: int) -> int:
    """Clusters of ``cluster_size`` CTAs of ``threads`` threads and ``smem_bytes`` of
    dynamic shared memory that ``device_index`` runs at once."""
    from cuda.bindings import driver

    # torch works in the device's primary context, but the calling thread (e.g. the
    # autograd engine's) need not have it current for the driver API: push it
    _checked(driver.cuCtxPushCurrent(_primary_context(device_index)))
    try:
        _, func = _probe_function(device_index)
        attr = driver.CUfunction_attribute
        _checked(driver.cuFuncSetAttribute(func, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           smem_bytes))
        _checked(driver.cuFuncSetAttribute(func, attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = cluster_size, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
        config.sharedMemBytes = smem_bytes
        cluster = driver.CUlaunchAttribute()
        cluster.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z = \
            cluster_size, 1, 1
        config.attrs = [cluster]
        config.numAttrs = 1
        return int(_checked(driver.cuOccupancyMaxActiveClusters(func, config)))
    finally:
        _checked(driver.cuCtxPopCurrent())
