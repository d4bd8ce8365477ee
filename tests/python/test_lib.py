"""The ctypes mirror of the C ABI: layouts, defaults, tensor views and error mapping."""
import ctypes
import re
from pathlib import Path

import pytest
import torch

import mok
from mok import _lib
from mok import functional as F


def test_struct_layouts():
    # Every mokConfig_t field is 8 bytes; mokTensor_t is 8 + 4 + 4 + 2*4*8 + 4 + 4 bytes.
    assert ctypes.sizeof(_lib.mokConfig) == 22 * 8
    assert ctypes.sizeof(_lib.mokTensor) == 88
    assert ctypes.sizeof(_lib.mokWeights) == 6 * 88
    # since C ABI 0.5 the forward's args end with the fp8 copies: 6 weights x (q, qt, scales)
    assert ctypes.sizeof(_lib.mokFp8Weights) == 18 * 88
    assert ctypes.sizeof(_lib.mokForwardArgs) == 10 * 88 + 18 * 88
    assert _lib.mokForwardArgs.fp8.offset == 10 * 88
    assert ctypes.sizeof(_lib.mokBackwardArgs) == 28 * 88 + 3 * 88 + 12 * 88
    assert ctypes.sizeof(_lib.mokPlanCapacity) == 24
    assert ctypes.sizeof(_lib.mokPlanArgs) == 16 + 5 * 88
    # a, b0, b1, block_expert, out, kind, num_blocks, then h, row_weight, wa, dtw_partials
    assert ctypes.sizeof(_lib.mokGroupedGemmArgs) == 5 * 88 + 16 + 4 * 88
    assert _lib.mokGroupedGemmArgs.h.offset == 5 * 88 + 16
    assert _lib.mokConfig.timeout_s.offset == 17 * 8 and _lib.mokConfig.num_threads.offset == 19 * 8
    # since 0.6: the fp8 wgrad kind's args, nine tensors then three int64
    assert ctypes.sizeof(_lib.mokGroupedWgradBlockScaledArgs) == 9 * 88 + 3 * 8


def test_default_config_matches_initializer_and_mokconfig():
    c = _lib.default_config()
    assert c.size == 176 and c.version == 3
    assert (c.ep_size, c.ep_rank, c.device, c.block_m, c.precision) == (1, 0, -1, 128, 0)
    for name, value in F.MoKConfig().__dict__.items():
        expect = _lib.PRECISIONS[value] if name == "precision" else value
        assert getattr(c, name) == expect, name


def _header_version():
    header = Path(__file__).resolve().parents[2] / "include" / "mok" / "mok.h"
    text = header.read_text()
    parts = [re.search(rf"#define MOK_VERSION_{p} (\d+)", text).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
    string = re.search(r'#define MOK_VERSION_STRING "([^"]+)"', text).group(1)
    return ".".join(parts), string


def test_version_and_cuda_flag():
    # One version number: mok.h's numbers, its string, the library's and the package's.
    numbers, string = _header_version()
    assert numbers == string == mok.__version__ == _lib.version_string()
    assert (int(numbers.split(".")[0]), int(numbers.split(".")[1])) == _lib.ABI_VERSION
    assert isinstance(mok.has_cuda(), bool)


def test_tensor_views():
    views = _lib.Views()
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)[:, 1:, ::2]
    v = views(t)
    assert v.data == t.data_ptr() and v.dtype == 1 and v.ndim == 3 and v.device == -1
    assert list(v.shape[:3]) == [2, 2, 2] and list(v.strides[:3]) == [12, 4, 2]
    absent = views(None)
    assert absent.data is None and absent.ndim == 0
    for dtype, code in [(torch.bfloat16, 0), (torch.int32, 2), (torch.int64, 3), (torch.float8_e4m3fn, 4),
                        (torch.uint8, 5)]:
        assert views(torch.zeros(3, dtype=dtype)).dtype == code
    with pytest.raises(ValueError, match="float64"):
        views(torch.zeros(2, dtype=torch.float64), "x")
    with pytest.raises(ValueError, match="at most 4"):
        views(torch.zeros(1, 1, 1, 1, 1), "x")


def test_error_mapping():
    assert issubclass(NotImplementedError, RuntimeError)
    c = _lib.default_config()
    handle = ctypes.c_void_p()
    with pytest.raises(ValueError, match="config.hidden = 0 must be positive"):
        _lib.check(_lib.lib.mokWorkspaceCreate(ctypes.byref(c), ctypes.byref(handle)))
    with pytest.raises(RuntimeError, match="workspace is NULL") as info:
        _lib.check(_lib.lib.mokWorkspaceGetConfig(None, ctypes.byref(c)))
    assert not isinstance(info.value, (ValueError, NotImplementedError))
    _lib.check(_lib.SUCCESS)
    assert _lib.error_string(_lib.NOT_SUPPORTED) == "not supported"
