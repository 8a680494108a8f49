"""fla_ext: robust, fast linear-attention ops (GLA, GSA, RWKV6, RWKV7) as PyTorch dispatcher ops.

    import fla_ext
    o, ht = fla_ext.fused_recurrent_rwkv6(r, k, v, w, u, output_final_state=True)

Ops are also reachable as ``torch.ops.fla.*`` (and from C++ via ``csrc/include/fla_ext``).
"""
import glob
import os

import torch


def _check_torch() -> None:
    """The library links against the torch it was built with: another torch would fail to load
    it with a missing symbol (or worse), so say which versions disagree."""
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:  # built without setup.py (CMake): nothing recorded
        return
    built, installed = TORCH_VERSION.split("+")[0], torch.__version__.split("+")[0]
    if built.split(".")[:2] != installed.split(".")[:2]:
        raise ImportError(
            f"fla_ext: the compiled library was built against torch {TORCH_VERSION}, but torch "
            f"{torch.__version__} is installed; rebuild fla_ext (`pip install --no-build-isolation "
            f"-e .` or `make build`) with this torch")


def _load_library() -> str:
    _check_torch()
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd")))
    if not found:
        raise ImportError(
            "fla_ext: the compiled library fla_ext/_C*.so is missing; build it with "
            "`pip install --no-build-isolation -e .` (or `make build`)"
        )
    torch.ops.load_library(found[0])
    return found[0]


_LIBRARY = _load_library()

from . import _fake  # noqa: E402,F401  (registers fake kernels)
from .ops import (  # noqa: E402
    chunk_gla,
    chunk_gsa,
    chunk_rwkv6,
    chunk_rwkv7,
    fused_mul_recurrent_rwkv7,
    fused_recurrent_gla,
    fused_recurrent_gsa,
    fused_recurrent_rwkv6,
    fused_recurrent_rwkv7,
    set_checks,
)
from .memory import keep_workspaces  # noqa: E402

__all__ = ["chunk_gla", "chunk_gsa", "chunk_rwkv6", "chunk_rwkv7", "fused_mul_recurrent_rwkv7",
           "fused_recurrent_gla", "fused_recurrent_gsa", "fused_recurrent_rwkv6",
           "fused_recurrent_rwkv7", "keep_workspaces", "set_checks"]
from ._version import __version__  # noqa: E402
