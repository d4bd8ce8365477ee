"""mok: a deterministic mixture-of-experts training layer (C++/CUDA core, PyTorch front)."""
from . import _lib
from . import experts, fp8, functional, nn, ops, quantized
from .functional import MoKConfig
from .quantized import quantize_weights

__version__ = _lib.version_string()


def cmake_prefix_path() -> str:
    """The prefix to give CMake (CMAKE_PREFIX_PATH) for find_package(mok) against this
    installed package: it holds lib/libmok.so, include/mok/ and lib/cmake/mok/."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    if not (here / "lib" / "cmake" / "mok" / "mokConfig.cmake").is_file():
        raise RuntimeError(f"mok at {here} is not an installed package (pip install .); in a source "
                           "checkout use `cmake --install build --prefix DIR` and give CMake DIR")
    return str(here)


def has_cuda() -> bool:
    """True when libmok was compiled with its CUDA part."""
    return _lib.has_cuda()


__all__ = ["functional", "ops", "nn", "experts", "fp8", "quantized", "quantize_weights", "MoKConfig", "has_cuda", "cmake_prefix_path", "__version__"]
