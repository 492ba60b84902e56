"""The C++ fast path (launch.cpp): compiled kernels launched and autograd nodes run
without Python. Built on first use with torch's extension builder (a C++ compiler and
ninja; about 30 s, then cached on disk). Where it cannot be built, or with
QUACK_KERNELS_NATIVE=0, ``module()`` is None and every op takes its Python path."""

from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path

_log = logging.getLogger("quack_kernels")


@functools.lru_cache(maxsize=None)
def module():
    """The built extension, or None (disabled, or the build failed: warned once)."""
    if os.environ.get("QUACK_KERNELS_NATIVE", "1") == "0":
        return None
    try:
        return build()
    except Exception as error:  # no compiler, no ninja, no headers: the Python path runs
        warnings.warn(f"quack_kernels: the C++ fast path is off ({type(error).__name__}: "
                      f"{error}); set QUACK_KERNELS_NATIVE=0 to skip the build")
        return None


def build():
    import tvm_ffi.libinfo
    from torch.utils import cpp_extension

    lib_dir = str(Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent)
    _log.info("quack_kernels: loading the C++ fast path (built once, about 30 s, then "
              "cached by torch's extension builder)")
    return cpp_extension.load(
        name="quack_kernels_native",
        sources=[str(Path(__file__).with_name("launch.cpp"))],
        extra_include_paths=[tvm_ffi.libinfo.find_include_path(),
                             tvm_ffi.libinfo.find_dlpack_include_path()],
        extra_cflags=["-O2"],
        extra_ldflags=[f"-L{lib_dir}", "-ltvm_ffi", f"-Wl,-rpath,{lib_dir}"],
    )
