"""Shared fixtures and tolerances. Test layout: ops/ (one file per family and mode: both modes of a
family side by side), oracle/ (the float64 references), layers/, and at this level the checks that
hold for every op (errors, safety, fake kernels, registration, the CUDA emulator); helpers that
build inputs and cases live in support/ (importable by name from every test)."""
import os
import sys
import zlib

# Outputs are NaN-filled before kernels run, so an element a kernel forgets to write fails.
os.environ.setdefault("FLA_EXT_POISON", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

import pytest  # noqa: E402
import torch  # noqa: E402

import fla_ext  # noqa: E402,F401

HAS_CUDA = torch.cuda.is_available()

# Under pytest-xdist (`-n N`) each worker takes an equal share of the cores for torch's CPU
# threads. The float64 oracles run OpenMP loops whose barriers spin, and with more threads than
# cores in all (workers x threads) a test that takes 0.2 s took 25 s (docs/design.md §8).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // _workers)))

# Every test that takes `device` runs on the CPU and, marked `cuda`, on the GPU when present.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]),
]

# docs/algorithms.md §8.3: (tol for values, tol for decay gradients, atol escape for ~0 references).
TOL = {
    torch.float64: (1e-10, 1e-10, 1e-12),
    torch.float32: (1e-5, 5e-5, 1e-6),
    torch.bfloat16: (1e-2, 2e-2, 1e-4),
    torch.float16: (1e-2, 2e-2, 1e-4),
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    den = ref.norm().item()
    return (x - ref).norm().item() / den if den > 0 else (x - ref).norm().item()


def assert_compiles_same(f, ins, wrt, device):
    """torch.compile(f, fullgraph=True) gives f's loss and gradients wrt `wrt`: aot_eager (CPU)
    runs eager's kernels, so to assert_close's defaults; inductor (GPU) generates its own code for
    the torch ops around the fla ops (GSA's softmax and sums) and may order their float32 sums
    differently, so there to the float32 value tolerance of docs/algorithms.md §8.3 (rel L2)."""
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    loss_c = cf(*ins)
    g_c = torch.autograd.grad(loss_c, wrt)
    loss_e = f(*ins)
    g_e = torch.autograd.grad(loss_e, wrt)
    for x, y in zip((loss_c,) + tuple(g_c), (loss_e,) + tuple(g_e)):
        if device == "cpu" or x.dtype != torch.float32:
            torch.testing.assert_close(x, y)
        else:
            assert x.shape == y.shape and torch.isfinite(x).all()
            assert rel_err(x, y) <= TOL[torch.float32][0], rel_err(x, y)


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float, atol: float):
    """docs/algorithms.md §8.2: rel L2 <= tol or max|x - ref| <= atol; never NaN/Inf."""
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    xd = x.detach().double().cpu()
    assert torch.isfinite(xd).all(), f"{name}: {(~torch.isfinite(xd)).sum().item()} non-finite values"
    r = rel_err(x, ref)
    m = (xd - ref.double().cpu()).abs().max().item() if x.numel() else 0.0
    assert r <= tol or m <= atol, f"{name}: rel err {r:.3e} > {tol:.0e} and max abs err {m:.3e} > {atol:.0e}"


@pytest.fixture
def gen(request):
    """Inputs differ from test to test (seeded by the test id) and repeat exactly on a rerun."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
