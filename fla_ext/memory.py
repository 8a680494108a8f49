"""What the chunk ops keep between a training forward and its backward.

By default a CUDA training forward of chunk_gla, chunk_rwkv6, chunk_gsa and chunk_rwkv7 keeps its
chunk-start states and per-chunk workspaces, so that its backward does not make them again. In
a model those are held for every layer at once from the forward to the backward (chunk_rwkv7:
32 KB per token and layer at 12 heads of 64); under ``keep_workspaces(False)`` the forwards keep
only what autograd keeps for any op (their inputs) and the backward recomputes the rest: less
memory, a slower backward. The RWKV layers follow the same setting with their token-shift and
channel mixes (layers/lean_linear.py). The environment variable ``FLA_EXT_KEEP_WORKSPACES``
(0/1/true/false/on/off/yes/no, as the ops read it) sets the default; the choice is read at each
forward.
"""
import contextlib
import os

__all__ = ["keep_workspaces", "keeps_workspaces"]

_VAR = "FLA_EXT_KEEP_WORKSPACES"


_FALSE, _TRUE = ("0", "false", "off", "no"), ("1", "true", "on", "yes")


def keeps_workspaces() -> bool:
    """Whether training forwards keep their workspaces now: True unless ``FLA_EXT_KEEP_WORKSPACES``
    is 0/false/off/no (or inside ``keep_workspaces(False)``), read as the ops read it
    (csrc/ops/common.cpp keeps_workspaces), so that the layers and the ops never disagree."""
    value = os.environ.get(_VAR, "").lower()
    if value in _FALSE:
        return False
    if value in _TRUE or not value:
        return True
    raise ValueError(f"fla_ext: {_VAR} must be one of 0/1/true/false/on/off/yes/no, got "
                     f"'{os.environ[_VAR]}'")


@contextlib.contextmanager
def keep_workspaces(keep: bool):
    """Within the block, training forwards keep (True) or do not keep (False) their chunk-start
    states and workspaces for the backward; the setting before the block comes back after it.
    The backward of a forward run inside the block may run outside it."""
    if not isinstance(keep, bool):
        raise TypeError(f"fla_ext: keep_workspaces takes a bool, got {type(keep).__name__} {keep!r}")
    before = os.environ.get(_VAR)
    os.environ[_VAR] = "1" if keep else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_VAR]
        else:
            os.environ[_VAR] = before
