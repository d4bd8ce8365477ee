"""ctypes binding over the C ABI of libmok (include/mok/mok.h).

The binding depends only on the C ABI, never on the Python ABI: any CPython and any torch
that can hand out data pointers can drive the same libmok.so.
"""
from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, c_char_p, c_double, c_int, c_int32, c_int64, c_size_t, c_uint64, c_void_p
from pathlib import Path
from typing import List, Optional, Sequence

import torch

# Version of the C ABI this binding mirrors (MOK_VERSION_MAJOR/MINOR, MOK_CONFIG_VERSION).
ABI_VERSION = (0, 6)
CONFIG_VERSION = 3
MAX_DIMS = 4
DEVICE_CPU = -1

# mokCheckSupport's flags
SUPPORT_BACKWARD = 1
SUPPORT_TRANSPOSED = 2

# mokResult_t
SUCCESS = 0
INVALID_ARGUMENT = 1
INVALID_USAGE = 2
NOT_SUPPORTED = 3
CUDA_ERROR = 4
TIMEOUT = 5
DEVICE_INVALID_ROUTE = 6
OUT_OF_MEMORY = 7
INTERNAL_ERROR = 8

# mokDtype_t
DTYPES = {
    torch.bfloat16: 0,
    torch.float32: 1,
    torch.int32: 2,
    torch.int64: 3,
    torch.float8_e4m3fn: 4,
    torch.uint8: 5,
}

# mokPrecision_t
PRECISIONS = {"bf16": 0, "mxfp8": 1, "fp8_block": 2}


class mokTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("dtype", c_int32),
        ("ndim", c_int32),
        ("shape", c_int64 * MAX_DIMS),
        ("strides", c_int64 * MAX_DIMS),
        ("device", c_int32),
        ("reserved", c_int32),
    ]


_CONFIG_INT_FIELDS = (
    "hidden", "intermediate", "shared_intermediate", "num_experts", "topk", "ep_size", "ep_rank",
    "max_tokens", "fwd_num_comm_sms", "bwd_num_comm_sms", "minibatch_size", "macrobatch_size",
    "block_m", "precision",
)


class mokConfig(ctypes.Structure):
    _fields_ = (
        [("size", c_uint64), ("version", c_uint64)]
        + [(name, c_int64) for name in _CONFIG_INT_FIELDS]
        + [
            ("schedule_capacity_multiplier", c_double),
            ("timeout_s", c_double),
            ("device", c_int64),
            ("num_threads", c_int64),
            # since config version 2
            ("num_blocks", c_int64),
            # since config version 3
            ("fp8_pow2_scales", c_int64),
        ]
    )


_default_config: Optional[mokConfig] = None


def default_config() -> mokConfig:
    """A fresh mokConfig equal to MOK_CONFIG_INITIALIZER, as the loaded library was compiled
    with it (mokGetDefaultConfig, asked once): the defaults are written once, in mok.h."""
    global _default_config
    if _default_config is None:
        config = mokConfig()
        check(lib.mokGetDefaultConfig(ctypes.byref(config)))
        _default_config = config
    return mokConfig.from_buffer_copy(_default_config)


def config_defaults() -> dict:
    """The library's default of every mokConfig field (size and version excluded)."""
    config = default_config()
    return {name: getattr(config, name) for name, _ in mokConfig._fields_ if name not in ("size", "version")}


class mokWeights(ctypes.Structure):
    _fields_ = [(name, mokTensor) for name in ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")]


class mokFp8Weight(ctypes.Structure):
    _fields_ = [("q", mokTensor), ("qt", mokTensor), ("scales", mokTensor)]


WEIGHT_NAMES = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


class mokFp8Weights(ctypes.Structure):
    _fields_ = [(name, mokFp8Weight) for name in WEIGHT_NAMES]


class mokForwardArgs(ctypes.Structure):
    _fields_ = [
        ("x", mokTensor),
        ("topk_ids", mokTensor),
        ("topk_weights", mokTensor),
        ("weights", mokWeights),
        ("y", mokTensor),
        ("fp8", mokFp8Weights),
    ]


class mokSaved(ctypes.Structure):
    _fields_ = [("h", mokTensor), ("shared_h", mokTensor)]


class mokBackwardArgs(ctypes.Structure):
    _fields_ = [
        ("fwd", mokForwardArgs),
        ("dy", mokTensor),
        ("dx", mokTensor),
        ("d_topk_weights", mokTensor),
        ("grads", mokWeights),
        ("main_grads", mokWeights),
    ]


class mokPlanCapacity(ctypes.Structure):
    _fields_ = [("max_rows", c_int64), ("max_blocks", c_int64), ("num_local_experts", c_int64)]


class mokPlanArgs(ctypes.Structure):
    _fields_ = [
        ("num_ranks", c_int64),
        ("topk_ids", POINTER(mokTensor)),
        ("rows", mokTensor),
        ("expert_count", mokTensor),
        ("expert_offset", mokTensor),
        ("block_expert", mokTensor),
        ("error", mokTensor),
    ]


class mokGroupedGemmArgs(ctypes.Structure):
    _fields_ = [("a", mokTensor), ("b0", mokTensor), ("b1", mokTensor), ("block_expert", mokTensor),
                ("out", mokTensor), ("kind", c_int64), ("num_blocks", c_int64),
                # read for kind dgrad_down_swiglu only
                ("h", mokTensor), ("row_weight", mokTensor), ("wa", mokTensor), ("dtw_partials", mokTensor)]


class mokGemmBlockScales(ctypes.Structure):
    _fields_ = [("a", mokTensor), ("b0", mokTensor), ("b1", mokTensor), ("out", mokTensor), ("out_pow2", c_int64),
                ("b_transposed", c_int64)]


class mokGroupedWgradArgs(ctypes.Structure):
    _fields_ = [("a", mokTensor), ("b", mokTensor), ("expert_offset", mokTensor), ("expert_count", mokTensor),
                ("out", mokTensor), ("acc", mokTensor), ("main_grad", mokTensor),
                ("accumulate", c_int64), ("store_acc", c_int64), ("num_blocks", c_int64)]


class mokGroupedWgradBlockScaledArgs(ctypes.Structure):
    _fields_ = [("a", mokTensor), ("b", mokTensor), ("a_scales", mokTensor), ("b_scales", mokTensor),
                ("expert_offset", mokTensor), ("expert_count", mokTensor),
                ("out", mokTensor), ("acc", mokTensor), ("main_grad", mokTensor),
                ("accumulate", c_int64), ("store_acc", c_int64), ("num_blocks", c_int64)]


# mokGemmKind_t
GEMM_KINDS = {"down": 0, "gate_up": 1, "dgrad_down": 2, "dgrad_gate_up": 3, "dgrad_down_swiglu": 4, "gate_up_preact": 5}


class mokTraceEvent(ctypes.Structure):
    _fields_ = [("begin_ns", c_uint64), ("end_ns", c_uint64), ("role", ctypes.c_uint32), ("kind", ctypes.c_uint32),
                ("block", c_int32), ("detail", c_int32)]


TRACE_RECORDERS = 4


def _candidates() -> List[Path]:
    """Where libmok.so is looked for, in order: $MOK_LIBRARY; inside the installed package
    (pip install . puts it in mok/lib); the build folder of a source checkout (build/lib)."""
    here = Path(__file__).resolve().parent
    paths = []
    if os.environ.get("MOK_LIBRARY"):
        paths.append(Path(os.environ["MOK_LIBRARY"]))
    paths.append(here / "lib" / "libmok.so")
    paths.append(here.parent.parent / "build" / "lib" / "libmok.so")
    return paths


def _load() -> ctypes.CDLL:
    tried = _candidates()
    if os.environ.get("MOK_LIBRARY") and not tried[0].is_file():
        raise ImportError(f"mok: MOK_LIBRARY={tried[0]} is not a file")
    for path in tried:
        if path.is_file():
            return ctypes.CDLL(str(path))
    raise ImportError(
        "mok: libmok.so not found. Install the package (pip install .), or build it in a source "
        "checkout (cmake -S . -B build -G Ninja && ninja -C build), or set MOK_LIBRARY to its full "
        "path. Tried: " + ", ".join(str(p) for p in tried)
    )


# Entry points of the EP >= 2 symmetric-memory path (C ABI 0.3), name -> (restype, argtypes).
OPTIONAL_SIGNATURES = {
    "mokGroupedGemmBlockScaled": (c_int, [POINTER(mokGroupedGemmArgs), POINTER(mokGemmBlockScales), c_void_p]),
    "mokQuantizeRowsE4m3": (c_int, [POINTER(mokTensor), POINTER(mokTensor), POINTER(mokTensor), c_int32, c_void_p]),
    "mokQuantizeWeights": (c_int, [POINTER(mokConfig), POINTER(mokWeights), POINTER(mokFp8Weights), c_int32,
                                   c_void_p]),
    "mokQuantizeBlocksE4m3": (c_int, [POINTER(mokTensor), POINTER(mokTensor), POINTER(mokTensor), POINTER(mokTensor),
                                      c_int32, c_void_p]),
    "mokGroupedWgradBlockScaled": (c_int, [POINTER(mokGroupedWgradBlockScaledArgs), c_void_p]),
    "mokQuantizeColsE4m3": (c_int, [POINTER(mokTensor), POINTER(mokTensor), POINTER(mokTensor), c_int32, c_void_p]),
    "mokForwardSave": (c_int, [c_void_p, POINTER(mokForwardArgs), POINTER(mokSaved), c_void_p]),
    "mokBackwardSaved": (c_int, [c_void_p, POINTER(mokBackwardArgs), POINTER(mokSaved), c_void_p]),
    "mokSymmetricBytes": (c_int, [POINTER(mokConfig), POINTER(c_size_t)]),
    "mokCheckSupport": (c_int, [POINTER(mokConfig), c_int32]),
    "mokWorkspaceCreateSymmetric": (c_int, [POINTER(mokConfig), POINTER(c_void_p), c_int64, POINTER(c_void_p)]),
    "mokForwardGroup": (c_int, [POINTER(c_void_p), POINTER(mokForwardArgs), c_int64, POINTER(c_void_p)]),
    "mokBackwardGroup": (c_int, [POINTER(c_void_p), POINTER(mokBackwardArgs), POINTER(mokSaved), c_int64,
                                 POINTER(c_void_p)]),
}


def _declare(lib: ctypes.CDLL) -> None:
    signatures = {
        "mokGetErrorString": (c_char_p, [c_int]),
        "mokGetLastError": (c_char_p, []),
        "mokGetVersion": (c_int, []),
        "mokGetDefaultConfig": (c_int, [POINTER(mokConfig)]),
        "mokHasCuda": (c_int, []),
        "mokWorkspaceCreate": (c_int, [POINTER(mokConfig), POINTER(c_void_p)]),
        "mokWorkspaceDestroy": (c_int, [c_void_p]),
        "mokWorkspaceDescribe": (c_int, [c_void_p, c_char_p, c_size_t, ctypes.POINTER(c_size_t)]),
        "mokWorkspaceGetConfig": (c_int, [c_void_p, POINTER(mokConfig)]),
        "mokPlanGetCapacity": (c_int, [POINTER(mokConfig), POINTER(mokPlanCapacity)]),
        "mokPlanBuild": (c_int, [POINTER(mokConfig), POINTER(mokPlanArgs), c_void_p]),
        "mokForward": (c_int, [c_void_p, POINTER(mokForwardArgs), c_void_p]),
        "mokBackward": (c_int, [c_void_p, POINTER(mokBackwardArgs), c_void_p]),
        "mokForwardEmulated": (c_int, [POINTER(mokConfig), POINTER(mokForwardArgs), c_int64]),
        "mokBackwardEmulated": (c_int, [POINTER(mokConfig), POINTER(mokBackwardArgs), c_int64]),
        "mokWorkspaceCheckErrors": (c_int, [c_void_p, c_int]),
        "mokGroupedGemm": (c_int, [POINTER(mokGroupedGemmArgs), c_void_p]),
        "mokGroupedWgrad": (c_int, [POINTER(mokGroupedWgradArgs), c_void_p]),
        "mokWorkspaceReadTrace": (c_int, [c_void_p, c_void_p, c_size_t, POINTER(c_size_t), POINTER(c_int64)]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    # Entry points a library built before them lacks: declared where present, and a call
    # through symbol() raises NotImplementedError otherwise (the import still works).
    for name, (restype, argtypes) in OPTIONAL_SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes


lib = _load()
_declare(lib)


def has_symbol(name: str) -> bool:
    """True when the loaded libmok.so exports `name`."""
    return hasattr(lib, name)


def symbol(name: str):
    """The C function `name`, or NotImplementedError when this libmok.so does not export it
    (a library built before the entry point existed)."""
    if not has_symbol(name):
        raise NotImplementedError(
            f"mok: {name} is not exported by {getattr(lib, '_name', 'libmok.so')} (version "
            f"{version_string()}); rebuild libmok (ninja -C build) from sources that have it")
    return getattr(lib, name)


def version_code() -> int:
    return int(lib.mokGetVersion())


def version_string() -> str:
    code = version_code()
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


if (version_code() // 10000, version_code() // 100 % 100) != ABI_VERSION:
    raise ImportError(f"mok: libmok.so is version {version_string()}, this binding mirrors the "
                      f"{ABI_VERSION[0]}.{ABI_VERSION[1]} C ABI")


def has_cuda() -> bool:
    """True when libmok was compiled with its CUDA part."""
    return bool(lib.mokHasCuda())


def error_string(result: int) -> str:
    return lib.mokGetErrorString(result).decode()


def last_error() -> str:
    return lib.mokGetLastError().decode(errors="replace")


def check(result: int) -> None:
    """Raises the Python exception that matches a mokResult_t (message: mokGetLastError)."""
    if result == SUCCESS:
        return
    message = last_error() or error_string(result)
    if result in (INVALID_ARGUMENT, DEVICE_INVALID_ROUTE):
        raise ValueError(message)
    if result == NOT_SUPPORTED:
        raise NotImplementedError(message)
    raise RuntimeError(f"{message} [{error_string(result)}]")


def device_index(device: torch.device, name: Optional[str] = None) -> int:
    """MOK_DEVICE_CPU for host memory, the CUDA ordinal otherwise. Any other device raises
    ValueError naming `name`, the tensor that is on it (None: the device argument itself)."""
    device = torch.device(device)
    if device.type == "cpu":
        return DEVICE_CPU
    if device.type == "cuda":
        return device.index if device.index is not None else torch.cuda.current_device()
    what = "device must be cpu or cuda" if name is None else f"{name} must be on a cpu or cuda device"
    raise ValueError(f"{what}, got {device}")


def stream_of(device_idx: int) -> Optional[int]:
    """The current torch CUDA stream of a device (None on the host)."""
    if device_idx < 0:
        return None
    return torch.cuda.current_stream(device_idx).cuda_stream


# The dtypes each tensor argument takes, as the C side checks them (src/runtime/layer.cpp):
# x, y, dx, dy, the weights and their gradients bf16; topk_ids int32 or int64; topk_weights,
# d_topk_weights and main_grads fp32.
BF16 = (torch.bfloat16,)
FP32 = (torch.float32,)
INT32 = (torch.int32,)
E4M3 = (torch.float8_e4m3fn,)
IDS = (torch.int32, torch.int64)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the names the C side's messages use)."""
    return str(dtype).replace("torch.", "")


def expect_tensor(t, name: str, dtypes: Optional[Sequence[torch.dtype]] = None,
                  ndim: Optional[int] = None) -> torch.Tensor:
    """t, after checking that it is a tensor (TypeError), of one of `dtypes` and with `ndim`
    dimensions (ValueError; None: not checked); each message names `name` and what it expected."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(dtype_name(d) for d in dtypes)}, got {dtype_name(t.dtype)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {list(t.shape)}")
    return t


class Views:
    """Turns tensors into mokTensor views and keeps every viewed tensor alive while it lives."""

    def __init__(self) -> None:
        self._alive: List[torch.Tensor] = []

    def __call__(self, t: Optional[torch.Tensor], name: str = "tensor",
                 dtypes: Optional[Sequence[torch.dtype]] = None) -> mokTensor:
        """The view of t (an absent view for None). `name` is the argument's, for the errors;
        `dtypes` the ones it takes (BF16, FP32, IDS...; None: any dtype mok has)."""
        view = mokTensor()
        if t is None:
            return view
        expect_tensor(t, name, dtypes if dtypes is not None else tuple(DTYPES))
        if t.dim() > MAX_DIMS:
            raise ValueError(f"{name} must have at most {MAX_DIMS} dimensions, got shape {list(t.shape)}")
        view.device = device_index(t.device, name)
        self._alive.append(t)
        view.data = t.data_ptr() or None
        view.dtype = DTYPES[t.dtype]
        view.ndim = t.dim()
        for i, (size, stride) in enumerate(zip(t.shape, t.stride())):
            view.shape[i] = size
            view.strides[i] = stride
        return view

    def weights(self, tensors: dict, prefix: str = "", dtypes: Optional[Sequence[torch.dtype]] = None) -> mokWeights:
        """A mokWeights from a dict name -> tensor (absent names stay absent)."""
        w = mokWeights()
        for name, _ in mokWeights._fields_:
            setattr(w, name, self(tensors.get(name), prefix + name, dtypes))
        return w
