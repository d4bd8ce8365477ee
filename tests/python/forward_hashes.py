"""Fixed inputs and output hashes of the forward, to hold the kernels' bits still while the
engine underneath them is rebuilt (the CPU reference's and each GPU model's bits are recorded
separately: the GPU sums in wgmma's order, the CPU in its own fixed order).

Inputs come from integer formulas, not from a random generator, so that they are the same
under every torch version.  `python3 tests/python/forward_hashes.py --record` (re)writes the
entries of the devices present into tests/python/data/forward_hashes.json; the test compares."""
import hashlib
import json
import sys
from pathlib import Path

import torch

HASHES = Path(__file__).resolve().parent / "data" / "forward_hashes.json"

# name: (H, I, I_s, E, k, T, minibatch, macrobatch); 0 = chosen by mok
CASES = {
    "small-shared": (256, 128, 128, 8, 2, 300, 0, 0),
    "ring-wraps": (512, 256, 0, 16, 4, 700, 256, 512),
    "dsv3-like": (7168, 2048, 0, 16, 8, 512, 0, 0),
}


def _grid(shape, a, b, scale):
    """((i*a + j*b) mod 997 - 498) / 498 * scale over the flattened trailing index j."""
    n = 1
    for s in shape[1:]:
        n *= s
    i = torch.arange(shape[0], dtype=torch.int64).unsqueeze(1)
    j = torch.arange(n, dtype=torch.int64).unsqueeze(0)
    v = ((i * a + j * b) % 997 - 498).to(torch.float32) / 498.0 * scale
    return v.reshape(shape).to(torch.bfloat16)


def inputs(name):
    H, I, Is, E, k, T, mb, macro = CASES[name]
    x = _grid((T, H), 131, 71, 1.0)
    t = torch.arange(T).unsqueeze(1)
    j = torch.arange(k).unsqueeze(0)
    ids = ((t * 7 + j * 3) % E).to(torch.int32)          # distinct per token: 3 is invertible mod E
    ids[5, k - 1] = -1                                     # one masked route
    tw = ((j + 1).to(torch.float32) / (k * (k + 1) / 2)).expand(T, k).contiguous()
    w = {"w_gate": _grid((E, I, H), 17, 29, H ** -0.5), "w_up": _grid((E, I, H), 23, 31, H ** -0.5),
         "w_down": _grid((E, H, I), 37, 41, I ** -0.5)}
    if Is:
        w.update(ws_gate=_grid((Is, H), 43, 47, H ** -0.5), ws_up=_grid((Is, H), 53, 59, H ** -0.5),
                 ws_down=_grid((H, Is), 61, 67, Is ** -0.5))
    return x, ids, tw, w, (mb, macro)


def digest(t):
    t = t.detach().cpu().contiguous().view(torch.int16)
    try:
        data = t.numpy().tobytes()
    except Exception:  # numpy missing: slower, same bytes
        data = b"".join(int(v & 0xFFFF).to_bytes(2, "little") for v in t.flatten().tolist())
    return hashlib.sha256(data).hexdigest()


def device_key(device):
    return "cpu" if device == "cpu" else "cuda:" + torch.cuda.get_device_name(device)


def run(name, device):
    from mok import functional as F
    x, ids, tw, w, (mb, macro) = inputs(name)
    config = F.MoKConfig(minibatch_size=mb, macrobatch_size=macro)
    y, _ = F.forward(x.to(device), ids.to(device), tw.to(device), **{n: v.to(device) for n, v in w.items()},
                     config=config)
    return digest(y)


def record():
    table = json.loads(HASHES.read_text()) if HASHES.is_file() else {}
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    import mok
    for device in devices:
        if device == "cuda" and not mok.has_cuda():
            continue
        key = device_key(device)
        table[key] = {name: run(name, device) for name in CASES
                      if device == "cuda" or CASES[name][0] <= 1024}  # the CPU reference: small cases
        print(key, table[key])
    HASHES.parent.mkdir(exist_ok=True)
    HASHES.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
    if "--record" in sys.argv:
        record()
    else:
        print(__doc__)
