"""Integrations of mok with other libraries, each in its own module and imported only on request
(`import mok` imports none of them, nor the libraries they need):

  mok.integrations.hf          Hugging Face transformers 5.x: `experts_implementation="mok"` for
                               the experts modules of its MoE models (pip install "mok[hf]")
  mok.integrations.torchtitan  TorchTitan 0.3: its MoE's routed experts through mok
                               (pip install "mok[torchtitan]")

What an integration cannot hand to mok runs the framework's own path, with one
MokFallbackWarning per (module class, reason) that names the reason.
"""
import warnings

import torch


class MokFallbackWarning(UserWarning):
    """A module ran its framework's own path instead of mok; the message says why."""


# (module class, reason) pairs already warned about, over every integration.
_warned: set = set()


def warn_once(module: torch.nn.Module, message: str, reason: str) -> None:
    """One MokFallbackWarning per (module class, reason): `message` names the module and the
    path it runs instead, then the reason."""
    key = (type(module), reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{message}: {reason}", MokFallbackWarning, stacklevel=4)
