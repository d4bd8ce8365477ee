"""mok: a deterministic mixture-of-experts training layer (C++/CUDA core, PyTorch front)."""
from . import _lib
from . import functional, nn, ops
from .functional import MoKConfig

__version__ = _lib.version_string()


def has_cuda() -> bool:
    """True when libmok was compiled with its CUDA part."""
    return _lib.has_cuda()


__all__ = ["functional", "ops", "nn", "MoKConfig", "has_cuda", "__version__"]
