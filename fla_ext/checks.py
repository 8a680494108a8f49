"""Input checks shared by the Python entry points and the layers.

The C++ ops check shapes, dtypes and devices themselves and validate a CPU ``cu_seqlens`` on
every call. What lives here is what only Python sees: fla's ``cu_seqlens_cpu`` keyword (the host
copy of a CUDA ``cu_seqlens``, validated without a device synchronisation) and the switch for the
value checks that read device memory.
"""
import os
from typing import Optional

import torch

__all__ = ["set_checks", "checks_enabled", "check_cu_seqlens_values", "check_finite"]

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no", "")


def checks_enabled() -> bool:
    """Whether ``FLA_EXT_CHECKS`` turns the value checks on; any value other than
    0/1/true/false/on/off/yes/no (any case) is an error, as in the C++ ops."""
    raw = os.environ.get("FLA_EXT_CHECKS", "")
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"fla_ext: FLA_EXT_CHECKS must be one of 0/1/true/false/on/off/yes/no, "
                     f"got {raw!r}")


def set_checks(enabled: bool = True) -> None:
    """Turn on value checks that read device memory (non-finite inputs, positive log decays,
    malformed ``cu_seqlens`` on the GPU). Same as ``FLA_EXT_CHECKS=1``. They synchronise with
    the host, so leave them off in production and inside CUDA-graph capture."""
    if not isinstance(enabled, bool):
        raise TypeError(f"fla_ext: set_checks takes a bool, got {type(enabled).__name__} "
                        f"{enabled!r}")
    os.environ["FLA_EXT_CHECKS"] = "1" if enabled else "0"


def check_cu_seqlens_values(cu: torch.Tensor, total: int, name: str = "cu_seqlens",
                            device_copy: Optional[torch.Tensor] = None) -> None:
    """Raises ValueError naming `name` unless the host tensor `cu` is 1-D integer sequence
    boundaries over `total` rows: cu[0] == 0, non-decreasing, cu[-1] == total. `device_copy`
    (the ``cu_seqlens`` it stands for) must then have the same number of entries."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"fla_ext: `{name}` must be a torch.Tensor, got {type(cu).__name__}")
    if cu.device.type != "cpu":
        raise ValueError(f"fla_ext: `{name}` must be a CPU tensor, got one on {cu.device}")
    if cu.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"fla_ext: `{name}` must be int64 (or int32), got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"fla_ext: `{name}` must be 1-D with at least 2 entries, got shape "
                         f"{list(cu.shape)}")
    if device_copy is not None and device_copy.shape != cu.shape:
        raise ValueError(f"fla_ext: `{name}` has shape {list(cu.shape)} but `cu_seqlens` has "
                         f"{list(device_copy.shape)}; it must be its host copy")
    # Tensor ops, not a Python loop: a layer checks the same boundaries in each of its convs and
    # ops, every step, and packed batches hold thousands of sequences.
    c = cu.to(torch.int64)
    if int(c[0]) != 0:
        raise ValueError(f"fla_ext: `{name}[0]` must be 0, got {int(c[0])}")
    drops = (c[1:] < c[:-1]).nonzero()
    if drops.numel():
        i = int(drops[0, 0]) + 1
        raise ValueError(f"fla_ext: `{name}` must be non-decreasing, but {name}[{i}] = "
                         f"{int(c[i])} < {name}[{i - 1}] = {int(c[i - 1])}")
    if int(c[-1]) != total:
        raise ValueError(f"fla_ext: `{name}[-1]` must equal the number of rows T = {total}, "
                         f"got {int(c[-1])}")


def check_finite(t: torch.Tensor, name: str) -> None:
    """A value check (reads the tensor): ValueError naming `name` at its first non-finite entry,
    worded as the C++ ops word it."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(f"fla_ext: `{name}` has a non-finite value at index {index} "
                         "(FLA_EXT_CHECKS)")
