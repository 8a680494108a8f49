"""The fake (meta) kernels check their arguments as the C++ ops do (fla_ext/_fake_checks.py).

  - A meta tensor among CPU tensors sends the whole call to the Meta kernel (the fake): it must
    be refused with a RuntimeError naming the argument, never answered with uninitialised outputs.
  - Under FakeTensorMode (torch.compile) a bad shape or dtype raises what the real op raises: the
    same exception type and message.
  - Good inputs under FakeTensorMode, or all on meta (shape inference), give the real op's output
    shapes and dtypes.
All on the CPU; CUDA appears only as fake tensors (FakeTensorMode makes them without a GPU).
"""
import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fla_ext

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
T, H, K, V, M = 5, 2, 4, 6, 3  # M: GSA's slots
CU = [0, 2, 5]

# op -> its family: which inputs it takes
FAMILY = {
    "fused_recurrent_rwkv6": "rwkv6", "fused_recurrent_rwkv6_bwd": "rwkv6",
    "chunk_rwkv6": "rwkv6", "chunk_rwkv6_train": "rwkv6", "chunk_rwkv6_bwd": "rwkv6",
    "fused_recurrent_gla": "gla", "fused_recurrent_gla_bwd": "gla",
    "chunk_gla": "gla", "chunk_gla_train": "gla", "chunk_gla_bwd": "gla",
    "fused_recurrent_rwkv7": "rwkv7", "fused_recurrent_rwkv7_bwd": "rwkv7",
    "chunk_rwkv7": "rwkv7", "chunk_rwkv7_train": "rwkv7", "chunk_rwkv7_bwd": "rwkv7",
    "chunk_gsa": "gsa", "fused_recurrent_gsa": "gsa",
    "chunk_gsa_core": "gsa_core", "chunk_gsa_core_train": "gsa_core",
    "chunk_gsa_core_bwd": "gsa_core",
}
OPS = list(FAMILY)
COMPOSITE = ("chunk_gsa", "fused_recurrent_gsa")  # C++ composites: their checks are C++ ones
DIAG = ("rwkv6", "gla", "rwkv7")
WORKSPACES = ("hst", "amat", "saved", "hst1", "hst2", "amat2")


def schema(name):
    return getattr(torch.ops.fla, name).default._schema


def is_bwd(name):
    return name.endswith("_bwd")


def inputs(name, *, B=1, varlen=True, dtype=F32, head_first=False, h0=True):
    """Every argument of op `name` by schema name: good CPU inputs (B must be 1 when varlen).
    The raw backward ops get grad_o, the final-state gradients and empty workspaces (what a CPU
    training forward returns)."""
    gen = torch.Generator().manual_seed(0)
    N = len(CU) - 1 if varlen else B
    acc = F64 if dtype == F64 else F32

    def act(D, decay=False, dt=dtype):
        x = torch.randn(B, T, H, D, generator=gen)
        x = -x.abs() if decay else x  # a log decay
        return (x.transpose(1, 2) if head_first else x).contiguous().to(dt)

    def st(R, C):
        return torch.randn(N, H, R, C, generator=gen).to(acc) if h0 else None

    x = dict(scale=None, output_final_state=True, reverse=False, head_first=head_first,
             cu_seqlens=torch.tensor(CU) if varlen else None)
    fam = FAMILY[name]
    if fam == "rwkv6":
        x.update(r=act(K), k=act(K), v=act(V), w=act(K, True),
                 u=torch.randn(H, K, generator=gen).to(dtype), initial_state=st(K, V))
    elif fam == "gla":
        g = act(K, True)
        x.update(q=act(K), k=act(K), v=act(V), g=g, gk=g, gv=act(V, True), initial_state=st(K, V))
    elif fam == "rwkv7":
        x.update(r=act(K), w=act(K, True), k=act(K), v=act(V), a=act(K), b=act(K),
                 initial_state=st(K, V))
    else:
        x.update(q=act(K), k=act(K), v=act(V), s=act(M), g=act(M, True), hk0=st(K, M),
                 hv0=st(M, V))
    if is_bwd(name):
        x.update(grad_o=act(V), grad_final_state=st(K, V), grad_hk=st(K, M), grad_hv=st(M, V),
                 p=torch.softmax(act(M, dt=acc), -1), **{n: torch.empty(0, dtype=acc)
                                                         for n in WORKSPACES})
    return x


def call(name, x):
    """torch.ops.fla.<name> on the arguments x by schema name (absent: None)."""
    return getattr(torch.ops.fla, name).default(*(x.get(a.name) for a in schema(name).arguments))


def _ref(x):
    """The name of the first activation, the one the others are checked against."""
    return "r" if "r" in x else "q"


def tensor_args(name, x):
    return [a.name for a in schema(name).arguments if isinstance(x.get(a.name), torch.Tensor)]


def outcome(f):
    """(exception type, message) of f(), or (None, its outputs)."""
    try:
        return None, f()
    except Exception as e:  # noqa: BLE001 (the type is what is compared)
        return type(e), str(e)


def fakes(mode, x, device=None):
    """x with fake copies of its tensors (moved to `device` if given)."""
    return {n: mode.from_tensor(t).to(device or t.device) if isinstance(t, torch.Tensor) else t
            for n, t in x.items()}


def run_fake(name, x, device=None):
    """outcome() of the op under FakeTensorMode on fake copies of x."""
    with FakeTensorMode() as mode:
        return outcome(lambda: call(name, fakes(mode, x, device)))


def flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def assert_like(got, ref, device):
    for i, (a, b) in enumerate(zip(flat(got), flat(ref), strict=True)):
        assert (a.shape, a.dtype, a.device.type) == (b.shape, b.dtype, device), f"output {i}"


# ---------------------------------------------------------------------------------------------
# (a) A meta tensor among CPU tensors: a RuntimeError naming it, for every tensor argument.

# What the C++ messages call an argument where it is not its schema name: chunk_gsa_core's checks
# are those of its two GLA passes (s is pass 1's `v`, the states pass 1's and pass 2's
# `initial_state` and `grad_final_state`), chunk_gsa's name fla's initial_state tuple.
SHOWN = {
    "gsa_core": dict(s="v", hk0="initial_state", hv0="initial_state", grad_hk="grad_final_state",
                     grad_hv="grad_final_state"),
    "gsa": dict(hk0="initial_state[0] (hk0)", hv0="initial_state[1] (hv0)"),
}
META_CASES = [pytest.param(n, a, id=f"{n}-{a}") for n in OPS for a in tensor_args(n, inputs(n))]


@pytest.mark.parametrize("name,arg", META_CASES)
def test_meta_among_cpu_is_refused(name, arg):
    x = inputs(name)
    x[arg] = x[arg].to("meta")
    shown = re.escape(SHOWN.get(FAMILY[name], {}).get(arg, arg))
    # "`arg` is on meta but ... on cpu", or, for the reference activation itself,
    # "`other` is on cpu but `arg` is on meta"
    with pytest.raises(RuntimeError, match=rf"`{shown}` is on meta but .* on cpu"
                                           rf"|is on cpu but `{shown}` is on meta"):
        call(name, x)


def test_meta_among_cpu_public_api():
    """The Python entry points, as a user calls them (messages as in the C++ ops)."""
    x = inputs("fused_recurrent_rwkv6")
    args = [x[n] for n in ("r", "k", "v", "w", "u")]
    with pytest.raises(RuntimeError, match=r"`initial_state` is on meta but the inputs are on cpu"):
        fla_ext.fused_recurrent_rwkv6(*args, initial_state=x["initial_state"].to("meta"),
                                      cu_seqlens=x["cu_seqlens"])
    with pytest.raises(RuntimeError, match=r"`cu_seqlens` is on meta but the inputs are on cpu"):
        fla_ext.chunk_rwkv6(*args, cu_seqlens=x["cu_seqlens"].to("meta"))
    x = inputs("chunk_gla")
    with pytest.raises(RuntimeError, match=r"`k` is on meta but `q` is on cpu"):
        fla_ext.chunk_gla(x["q"], x["k"].to("meta"), x["v"], x["g"])
    q = x["q"].requires_grad_()  # a recording call: the training forward's fake
    with pytest.raises(RuntimeError, match=r"`initial_state` is on meta but the inputs are on cpu"):
        fla_ext.chunk_gla(q, x["k"], x["v"], x["g"], initial_state=x["initial_state"].to("meta"))
    x = inputs("chunk_rwkv7")
    with pytest.raises(RuntimeError, match=r"`b` is on meta but `r` is on cpu"):
        fla_ext.chunk_rwkv7(*(x[n] for n in ("r", "w", "k", "v", "a")), x["b"].to("meta"))


@pytest.mark.parametrize("name", [n for n in OPS if n not in COMPOSITE])
def test_cuda_among_cpu_under_fake_mode(name):
    """A fake CUDA tensor among fake CPU ones: the C++ device message."""
    x = inputs(name)
    with FakeTensorMode() as mode:
        fx = fakes(mode, x)
        fx["k"] = fx["k"].to("cuda")
        with pytest.raises(RuntimeError, match=rf"`k` is on cuda:0 but `{_ref(x)}` is on cpu"):
            call(name, fx)


# ---------------------------------------------------------------------------------------------
# (b) Bad shapes and dtypes: under FakeTensorMode the real op's exception and message.

def _decays(x):
    return [n for n in ("w", "g", "gk") if n in x]


def _resized(x, names, D):
    """The activations `names` of x with last dim D."""
    return {n: torch.randn(*x[n].shape[:-1], D).to(x[n]) for n in names}


def _cut(name, dim, n):
    """A mutation: `name` cut to its first n entries along dim."""
    return lambda x: {name: x[name].narrow(dim, 0, n)}


def _cast(name, dtype):
    """A mutation: `name` in another dtype."""
    return lambda x: {name: x[name].to(dtype)}


def _regrouped(x):
    """k, v, s, g with 3 heads for q's 2."""
    return {n: torch.cat([x[n], x[n][:, :, :1]], 2) for n in ("k", "v", "s", "g")}


# (families, for the backward ops only, mutation of the good inputs x, regex with {ref})
BAD = {
    "3-D reader": (DIAG + ("gsa_core",), False, lambda x: {_ref(x): x[_ref(x)][..., 0]},
                   r"`{ref}` must be 4-D, got shape \[1, 5, 2\]"),
    "integer reader": (DIAG, False, lambda x: {_ref(x): x[_ref(x)].long()},
                       r"`{ref}` must be float32, bfloat16 or float16 \(float64 on CPU\), "
                       r"got Long on cpu"),
    "k shape": (DIAG + ("gsa_core",), False, lambda x: _resized(x, ["k"], K + 1),
                r"`k` must have the shape of `{ref}` \[1, 5, 2, 4\] \(\[B, T, H, D\]\)"),
    "decay shape": (DIAG, False, lambda x: _resized(x, _decays(x), K + 1),
                    r"`(w|g|gk)` must have the shape of `{ref}`"),
    "v dtype": (DIAG + ("gsa_core",), False, _cast("v", F64),
                r"`v` has dtype Double but `(r|q|p)` has dtype Float; all activations must match"),
    "v rows": (DIAG + ("gsa_core",), False, _cut("v", 1, 4),
               r"`v` must be \[B, T, H, D\] with B, T, H of `(r|q|p)`"),
    "K > 256": (DIAG, False, lambda x: _resized(x, [_ref(x), "k"] + _decays(x), 300),
                r"K \(last dim of {ref}, k, (w|g|gk)\) must be in \[1, 256\], got 300"),
    "V > 256": (DIAG, False, lambda x: _resized(x, ["v"], 300),
                r"V \(last dim of v\) must be in \[1, 256\], got 300"),
    "state shape": (DIAG, False, _cut("initial_state", -1, 5),
                    r"`initial_state` must have shape \[N, H, K, V\] = \[2, 2, 4, 6\], got "
                    r"\[2, 2, 4, 5\]"),
    "state dtype": (DIAG, False, _cast("initial_state", F64),
                    r"`initial_state` must be Float \(states are float32"),
    "cu_seqlens dtype": (DIAG + ("gsa_core",), False, _cast("cu_seqlens", F32),
                         r"`cu_seqlens` must be int64 \(or int32\), got Float"),
    "cu_seqlens 2-D": (DIAG + ("gsa_core",), False, lambda x: {"cu_seqlens": x["cu_seqlens"][None]},
                       r"`cu_seqlens` must be 1-D with at least 2 entries"),
    "cu_seqlens with B = 2": (DIAG + ("gsa_core",), False,
                              lambda x: {n: torch.cat([t, t]) for n, t in x.items()
                                         if isinstance(t, torch.Tensor) and t.dim() == 4},
                              r"with `cu_seqlens` the batch size must be 1, got B = 2"),
    "scale nan": (DIAG + ("gsa_core",), False, lambda x: {"scale": math.nan},
                  r"`scale` must be finite, got nan"),
    "grad_o shape": (DIAG, True, lambda x: {"grad_o": x["k"]},
                     r"`grad_o` must have the shape of `v` \[1, 5, 2, 6\], got \[1, 5, 2, 4\]"),
    "grad_o dtype": (DIAG + ("gsa_core",), True, _cast("grad_o", F64),
                     r"`grad_o` has dtype Double but `(r|q|p)` has dtype Float"),
    "grad_final_state shape": (DIAG, True, _cut("grad_final_state", 0, 1),
                               r"`grad_final_state` must have shape \[N, H, K, V\] = "
                               r"\[2, 2, 4, 6\], got \[1, 2, 4, 6\]"),
}
FAMILY_BAD = {
    "u shape": (("rwkv6",), False, _cut("u", 0, 1),
                r"`u` must have shape \[H, K\] = \[2, 4\], got \[1, 4\]"),
    "u dtype": (("rwkv6",), False, _cast("u", torch.int64),
                r"`u` must be float32, bfloat16, float16 or float64, got Long"),
    "gv shape": (("gla",), False, _cut("gv", -1, 4),
                 r"`gv` must have the shape of `v` \[1, 5, 2, 6\]"),
    "gv dtype": (("gla",), False, _cast("gv", F64),
                 r"`gv` has dtype Double but `v` has dtype Float"),
    "wide q, v fp16": (("gla",), False, lambda x: {"k": x["k"].bfloat16(), "v": x["v"].half(),
                                                "g": x["g"].bfloat16(), "gk": x["gk"].bfloat16()},
                       r"`v` has dtype Half but `k` has dtype BFloat16"),
    "a shape": (("rwkv7",), False, lambda x: _resized(x, ["a"], K + 1),
                r"`a` must have the shape of `r` \[1, 5, 2, 4\]"),
    "b dtype": (("rwkv7",), False, _cast("b", F16),
                r"`b` has dtype Half but `r` has dtype Float"),
    "hst not the workspace": (("rwkv6", "gla"), True, lambda x: {"hst": torch.zeros(3, 2, 2, 2)},
                              r"`hst` must be the Float workspace \[5, 2, 4, 6\] on cpu returned "
                              r"by the _train op, got Float \[3, 2, 2, 2\] on cpu"),
    "amat not the workspace": (("rwkv6", "gla"), True, lambda x: {"amat": torch.zeros(5, 2, 64)},
                               r"`amat` must be the Float workspace \[5, 2, 64, 64\]"),
    "hst without amat": (("rwkv6", "gla"), True, lambda x: {"hst": torch.zeros(5, H, K, V)},
                         r"`hst` and `amat` come together from the _train op"),
    "g shape": (("gsa_core",), False, _cut("g", -1, 2),
                r"`g` must have the shape of `s` \[1, 5, 2, 3\]"),
    # chunk_gsa_core names the states as its two GLA passes do, chunk_gsa by fla's tuple
    "hk0 shape": (("gsa_core", "gsa"), False, _cut("hk0", -1, 2),
                  r"`initial_state(\[0\] \(hk0\))?` must have shape \[N, H, K, [VM]\] = "
                  r"\[[12], 2, 4, 3\]"),
    "hv0 shape": (("gsa_core", "gsa"), False, _cut("hv0", -1, 2),
                  r"`initial_state(\[1\] \(hv0\))?` must have shape \[N, H, [KM], V\] = "
                  r"\[[12], 2, 3, 6\]"),
    "p dtype": (("gsa_core",), True, _cast("p", F64),
                r"`p` must be the Float softmax \[1, 5, 2, 3\] returned by chunk_gsa_core_train"),
    "grad_hv shape": (("gsa_core",), True, _cut("grad_hv", 0, 1),
                      r"`grad_final_state` must have shape \[N, H, K, V\] = \[2, 2, 3, 6\]"),
    "grad_hk dtype": (("gsa_core",), True, _cast("grad_hk", F64),
                      r"`grad_final_state` must be Float"),
    "gsa heads": (("gsa",), False, _regrouped,
                  r"the heads of `q` \(2\) must be a multiple of the heads of `k`, `v`, `s` \(3\)"),
    "gsa s dtype": (("gsa",), False, _cast("s", F64),
                    r"`s` has dtype Double but `q` has dtype Float"),
}


def _bad_inputs(name):
    # the composites' C++ checks read a CPU cu_seqlens's values, which fake tensors have not
    # (test_good_input_under_fake_mode): their bad cases have no cu_seqlens
    return inputs(name, varlen=name not in COMPOSITE)


def _bad_cases():
    """(op, mutation, message) for every op of a case's families that takes what it changes."""
    out = []
    for case, (families, bwd_only, mutate, msg) in {**BAD, **FAMILY_BAD}.items():
        for name in OPS:
            if (FAMILY[name] in families and (is_bwd(name) or not bwd_only)
                    and _taken(name, mutate(_bad_inputs(name)))):
                out.append(pytest.param(name, mutate, msg, id=f"{name}-{case}"))
    return out


def _taken(name, changes):
    """The changes to arguments op `name` takes (x holds more: gk and g, the gradients)."""
    args = {a.name for a in schema(name).arguments}
    return {n: t for n, t in changes.items() if n in args}


@pytest.mark.parametrize("name,mutate,msg", _bad_cases())
def test_bad_input_under_fake_mode_raises_as_the_op(name, mutate, msg):
    x = _bad_inputs(name)
    x.update(_taken(name, mutate(x)))
    msg = msg.format(ref=_ref(x))
    real = outcome(lambda: call(name, x))
    fake = run_fake(name, x)
    assert real[0] in (ValueError, RuntimeError), f"the real op: {real}"
    assert re.search(msg, real[1]), real[1]
    assert fake == real


@pytest.mark.parametrize("name", ["chunk_gla", "chunk_gla_train", "chunk_gla_bwd"])
def test_both_decays_on_fake_cuda(name):
    """The CUDA chunk engine takes g or gv, not both (the check reads the device: fake CUDA)."""
    exc, msg = run_fake(name, inputs(name), device="cuda")
    assert exc is ValueError and "not both together (the CPU backend takes both)" in msg, msg


# (training forward, its backward, the workspaces, what the C++ message calls the first one)
KEPT = [("chunk_rwkv6_train", "chunk_rwkv6_bwd", ("hst", "amat"), "hst"),
        ("chunk_gla_train", "chunk_gla_bwd", ("hst", "amat"), "hst"),
        ("chunk_rwkv7_train", "chunk_rwkv7_bwd", ("saved",), "saved"),
        ("chunk_gsa_core_train", "chunk_gsa_core_bwd", ("hst1", "hst2", "amat2"), "hst")]


@pytest.mark.parametrize("train,bwd,names,shown", KEPT, ids=[k[0] for k in KEPT])
def test_workspaces_on_fake_cuda(train, bwd, names, shown):
    """On CUDA the training forwards keep workspaces; the backward takes those and refuses
    others."""
    x = inputs(bwd)
    x["gv"] = None  # the CUDA chunk_gla takes one decay
    with FakeTensorMode() as mode:
        fx = fakes(mode, x, "cuda")
        kept = call(train, fx)[-len(names):]
        assert all(t.numel() > 0 for t in kept)
        fx.update(zip(names, kept))
        call(bwd, fx)
        fx[names[0]] = kept[0][:1]
        with pytest.raises(ValueError, match=rf"`{shown}` must be the"):
            call(bwd, fx)


@pytest.mark.parametrize("B,H,T,force,pipeline,strided_kept", [
    (2, 128, 150, "", "", True), (2, 127, 150, "", "", False), (2, 128, 150, "0", "", False),
    (1, 2, 150, "1", "", True), (1, 2, 150, "", "1", True), (1, 32, 8192, "", "", True),
    (1, 33, 8192, "", "", False), (1, 32, 4096, "", "", False), (1, 32, 8192, "", "0", False)],
    ids=["256pairs", "254pairs", "forced_off", "forced_on", "windows_forced", "windows_long",
         "windows_66ctas", "windows_short", "windows_off"])
def test_rwkv7_saved_size_on_fake_cuda(B, H, T, force, pipeline, strided_kept, monkeypatch):
    """chunk_rwkv7_train's `saved` on CUDA (ops/chunk_rwkv7.cpp saved_floats): where the training
    forward takes the fused kernel (bf16, K = V = 64, from 256 (sequence, head) pairs, or
    FLA_EXT_RWKV7_FUSED=1), or the two-kernel forward runs in pipelined windows (at most 64 sweep
    CTAs and windows of at least 64 chunks, or FLA_EXT_RWKV7_PIPELINE=1: sweep_strided), the
    state before every fourth chunk and the final one alone; every chunk-start state and the
    workspace after them otherwise."""
    monkeypatch.setenv("FLA_EXT_RWKV7_FUSED", force)
    monkeypatch.setenv("FLA_EXT_RWKV7_PIPELINE", pipeline)
    K = 64
    slots = B * ((T + 15) // 16 + 1)
    states = (slots * H * K * K + 3) // 4 * 4
    strided = (B * ((T + 63) // 64 + 1) * H * K * K + 3) // 4 * 4  # before chunks 0, 4, 8, .. and the final one
    workspace = slots * H * (4 * 16 * K + K + 5 * 16 * 20)  # W, Q~, K^, B^, gamma, 4 matrices and X
    with FakeTensorMode():
        r, w, k, v, a, b = (torch.empty(B, T, H, K, dtype=BF16, device="cuda") for _ in range(6))
        saved = torch.ops.fla.chunk_rwkv7_train(r, w, k, v, a, b, 1.0, None, False, None, False)[2]
    assert saved.shape == (strided if strided_kept else states + workspace,)


@pytest.mark.parametrize("dtype,varlen,strided_kept", [(BF16, False, True), (torch.float16, False, True),
                                                       (torch.float32, False, False), (BF16, True, True),
                                                       (torch.float32, True, False)],
                         ids=["bf16", "fp16", "fp32", "bf16_varlen", "fp32_varlen"])
def test_rwkv7_saved_size_at_K128_on_fake_cuda(dtype, varlen, strided_kept):
    """At K = V = 128 a 16-bit training forward keeps the strided states from its sweep whatever
    the pairs and cu_seqlens (sweep_strided; under cu_seqlens in the slot map of 64-row chunks),
    and prep's workspace after them (outside the pipelined windows); fp32 keeps every state and
    the workspace. The backward takes what the forward kept and refuses a shorter one."""
    B, T, H, K = 2, 150, 3, 128
    N = 3 if varlen else B
    slots_of = lambda rows: (T // rows + 2 * N + 1) if varlen else B * ((T + rows - 1) // rows + 1)
    slots = slots_of(16)
    states = (slots * H * K * K + 3) // 4 * 4
    strided = (slots_of(64) * H * K * K + 3) // 4 * 4
    workspace = slots * H * (4 * 16 * K + K + 5 * 16 * 20)
    with FakeTensorMode():
        Bx, cu = (1, torch.tensor([0, 40, 40, T], device="cuda")) if varlen else (B, None)
        r, w, k, v, a, b = (torch.empty(Bx, T, H, K, dtype=dtype, device="cuda") for _ in range(6))
        saved = torch.ops.fla.chunk_rwkv7_train(r, w, k, v, a, b, 1.0, None, False, cu, False)[2]
        torch.ops.fla.chunk_rwkv7_bwd(r, w, k, v, a, b, torch.empty_like(v), None, 1.0, None, cu, False, saved)
        with pytest.raises(ValueError, match="`saved` must be the"):
            torch.ops.fla.chunk_rwkv7_bwd(r, w, k, v, a, b, torch.empty_like(v), None, 1.0, None, cu, False, saved[:4])
    assert saved.shape == (strided + workspace if strided_kept else states + workspace,)


# ---------------------------------------------------------------------------------------------
# (c) Good inputs: the real op's output shapes and dtypes, under FakeTensorMode and on meta.

GOOD = [dict(), dict(varlen=False, B=2), dict(head_first=True), dict(h0=False),
        dict(dtype=F64), dict(dtype=BF16)]  # BF16: GLA's with a wide (float32) q


def _good(name, kw):
    x = inputs(name, **kw)
    if FAMILY[name] == "gla" and kw.get("dtype") == BF16:
        x["q"] = x["q"].float()
        if is_bwd(name):
            x["grad_o"] = x["grad_o"].float()
    return x


def _case(name, kw, **marks):
    return pytest.param(name, kw, id="-".join([name] + [f"{k}={v}" for k, v in kw.items()]),
                        **marks)


GOOD_CASES = [_case(n, kw) for n in OPS for kw in GOOD]
# chunk_gsa / fused_recurrent_gsa are C++ composites that run their C++ checks under
# FakeTensorMode: check_cu_seqlens must not read the values of a fake CPU cu_seqlens.
FAKE_CASES = GOOD_CASES


@pytest.mark.parametrize("name,kw", FAKE_CASES)
def test_good_input_under_fake_mode(name, kw):
    x = _good(name, kw)
    real = call(name, x)
    exc, fake = run_fake(name, x)
    assert exc is None, fake
    assert_like(fake, real, "cpu")


@pytest.mark.parametrize("name,kw", GOOD_CASES)
def test_all_meta_is_shape_inference(name, kw):
    x = _good(name, kw)
    real = call(name, x)
    meta = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in x.items()}
    if kw.get("dtype") == F64:  # float64 is for the CPU only, as in the C++ checks
        with pytest.raises(ValueError, match=r"\(float64 on CPU\), got Double on meta"):
            call(name, meta)
        return
    assert_like(call(name, meta), real, "meta")


# ---------------------------------------------------------------------------------------------
# None for a required tensor (a raw torch.ops.fla call may pass one): the op's ValueError. The
# forward ops' Autograd kernels check that in C++ before anything else; the _train and _bwd ops
# (no Autograd kernel) reach the fake kernel with it.

NONE_CASES = [pytest.param(n, a.name, id=f"{n}-{a.name}")
              for n in OPS if n.endswith(("_train", "_bwd"))
              for a in schema(n).arguments if str(a.type) == "Tensor"]


@pytest.mark.parametrize("name,arg", NONE_CASES)
def test_none_for_a_required_tensor(name, arg):
    x = inputs(name)
    x[arg] = None
    shown = SHOWN.get(FAMILY[name], {}).get(arg, arg)
    real = outcome(lambda: call(name, x))
    assert real == (ValueError, f"fla_ext: `{shown}` must be a tensor, got None")
    assert run_fake(name, x) == real
    on_meta = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in x.items()}
    assert outcome(lambda: call(name, on_meta)) == real
