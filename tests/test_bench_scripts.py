"""The benchmark scripts run end to end on the CPU (tiny shapes): benchmarks/grid.py writes the
rows the issues ask for, merged into an existing file row by row; benchmarks/env_ab.py compares
settings in one process; benchmarks/cp_overhead.py
times an op with and without a one-rank context; benchmarks/cp_scale.py splits one sequence over
two gloo ranks; benchmarks/model_step.py trains a tiny RWKV7ForCausalLM; benchmarks/ab_builds.sh
(two builds on a GPU) parses and prints its usage; benchmarks/operand_precision.py (a precision
study of chunk_rwkv7's algebra) matches the oracle with exact products; benchmarks/sass_counts.py
(static counts from SASS) reads cuobjdump's text: kernels, their counts and their mma loops."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("op", ["chunk_rwkv7", "chunk_gla", "chunk_rwkv6", "chunk_gsa"])
def test_grid_quick_cpu(op, tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "grid.py"), op, "--quick",
           "--device", "cpu", "--no-fla", "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for _ in range(2):  # the second run replaces the first one's rows
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    rows = json.loads((tmp_path / f"cpu_{op}_grid.json").read_text())["rows"]
    assert sorted(r["mode"] for r in rows) == ["fwd", "fwd_nograd", "fwdbwd"]
    for r in rows:
        assert {"op", "impl", "gpu", "B", "T", "H", "K", "V", "dtype", "mode", "ms", "peak_mib"} <= set(r)
        assert r["impl"] == "fla_ext" and r["ms"] > 0


def test_env_ab_quick_cpu(tmp_path):
    """benchmarks/env_ab.py measures every point and mode under each setting in turn, each round;
    a setting's variables hold only inside its calls (set, then restored or removed)."""
    out = tmp_path / "ab.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "env_ab.py"), "chunk_rwkv7", "--points",
           "1,2,16,40,fp32", "--settings", "", "FLA_EXT_WORKSPACE_MIB=0", "--modes", "fwd", "fwdbwd",
           "--rounds", "2", "--device", "cpu", "--quick", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FLA_EXT_WORKSPACE_MIB", None)
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["round"], r["setting"]) for r in rows] == [
        (m, k, s) for m in ("fwd", "fwdbwd") for k in (0, 1) for s in ("", "FLA_EXT_WORKSPACE_MIB=0")]
    assert all(r["ms"] > 0 and r["B"] == 1 and r["T"] == 40 for r in rows)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import env_ab
    finally:
        sys.path.pop(0)
    os.environ["FLA_EXT_TEST_A"] = "kept"
    os.environ.pop("FLA_EXT_TEST_B", None)
    try:
        with env_ab.environment(env_ab.parse_setting("FLA_EXT_TEST_A=1,FLA_EXT_TEST_B=2")):
            assert os.environ["FLA_EXT_TEST_A"] == "1" and os.environ["FLA_EXT_TEST_B"] == "2"
        assert os.environ["FLA_EXT_TEST_A"] == "kept" and "FLA_EXT_TEST_B" not in os.environ
    finally:
        os.environ.pop("FLA_EXT_TEST_A", None)
    assert env_ab.parse_setting("") == {}


def test_grid_resume_and_runs(tmp_path):
    """Every row names its run; --resume measures nothing where every impl has a row, and a run
    without it replaces the rows (a new run id). A note in the file's meta survives both."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "grid.py"), "chunk_gla", "--quick",
           "--device", "cpu", "--no-fla", "--modes", "fwd", "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    path = tmp_path / "cpu_chunk_gla_grid.json"
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    data = json.loads(path.read_text())
    (first,) = data["rows"]
    assert first["run"]
    data["meta"]["note"] = "which runs"
    path.write_text(json.dumps(data))
    out = subprocess.run(cmd + ["--resume"], check=True, env=env, capture_output=True, text=True, timeout=300)
    assert "measured already (--resume)" in out.stdout
    data = json.loads(path.read_text())
    assert data["rows"] == [first] and data["meta"]["note"] == "which runs"
    subprocess.run(cmd + ["--modes", "fwd", "fwdbwd", "--resume"], check=True, env=env, capture_output=True,
                   timeout=300)
    rows = json.loads(path.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["fwd", "fwdbwd"] and rows[0] == first  # only fwdbwd measured
    import time
    time.sleep(1.1)  # a later second: another run id
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    data = json.loads(path.read_text())
    (again,) = [r for r in data["rows"] if r["mode"] == "fwd"]
    assert again["run"] != first["run"] and data["meta"]["note"] == "which runs"


def test_cp_overhead_quick_cpu(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cp_overhead.py"), "--device", "cpu",
                    "--quick", "--out", str(tmp_path)], check=True, env=env, capture_output=True, timeout=300)
    rows = json.loads((tmp_path / "cpux1_cp_overhead.json").read_text())["rows"]
    assert [r["op"] for r in rows] == ["chunk_gla", "chunk_rwkv7"]
    assert all(r["ms_plain"] > 0 and r["ms_cp"] > 0 and r["gather_bytes_per_rank"] > 0 for r in rows)


def test_cp_scale_quick_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cp_scale.py"), "--device", "cpu",
                    "--quick", "--out", str(tmp_path)], check=True, env=env, capture_output=True, timeout=300)
    rows = json.loads((tmp_path / "cpux2_cp.json").read_text())["rows"]
    assert [(r["op"], r["world"]) for r in rows] == [("chunk_rwkv7", 1), ("chunk_gla", 1),
                                                      ("chunk_rwkv7", 2), ("chunk_gla", 2)]
    # one fwd+bwd at H = 2, K = V = 16 gathers S0 and M of one sequence (fp32): RWKV7's M is
    # K x K, GLA's the K + V decays; the plain op on one rank moves nothing
    assert [r["gather_bytes_per_rank"] for r in rows] == [0, 0, 2 * (256 + 256) * 4, 2 * (256 + 32) * 4]
    assert all(r["ms"] > 0 for r in rows)
    assert all(r["max_rel_err_vs_one_gpu"] <= 1e-5 for r in rows if r["world"] == 2)


def test_model_step_quick_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "model_step.py"), "--device", "cpu",
                    "--quick", "--no-fla", "--out", str(tmp_path)], check=True, env=env, capture_output=True,
                   timeout=300)
    rows = json.loads((tmp_path / "cpu_rwkv7_lm_step.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["fla_ext", "fla_ext (keep_workspaces=False)"]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["last_loss"] < row["first_loss"]
    assert rows[0]["last_loss"] == rows[1]["last_loss"]  # the same steps, workspaces kept or not


def test_grid_autotune_cache_keeps_only_the_results(tmp_path):
    """--autotune-cache DIR: the run's Triton cache (a temporary folder) starts from the results
    in DIR/<gpu>.autotune.json, and afterwards that one file holds every autotuning result
    (*.autotune.json) the run left there too, nothing else: small and flat to carry."""
    cache = tmp_path / "cache"
    cache.mkdir()
    kept = {"abc123/chunk_fwd_kernel.autotune.json": '{"configs": 1}'}  # from an earlier run
    (cache / "cpu.autotune.json").write_text(json.dumps(kept))
    probe = tmp_path / "probe.py"  # in the run: what the cache holds, and a result of its own
    probe.write_text(
        "import os, runpy, sys\n"
        "import fla_ext  # noqa: F401\n"
        "def hook():\n"
        "    root = os.environ['TRITON_CACHE_DIR']\n"
        "    print('restored', open(os.path.join(root, 'abc123', 'chunk_fwd_kernel.autotune.json')).read())\n"
        "    os.makedirs(os.path.join(root, 'def456'))\n"
        "    open(os.path.join(root, 'def456', 'new.autotune.json'), 'w').write('{}')\n"
        "    open(os.path.join(root, 'def456', 'kernel.cubin'), 'wb').write(bytes(64))\n"
        "import bench_ops\n"
        "orig, done = bench_ops._peak_mb, []\n"
        "def peak(*a, **k):  # measured inside the run, after the cache is set up\n"
        "    if not done:\n"
        "        hook(); done.append(1)\n"
        "    return orig(*a, **k)\n"
        "bench_ops._peak_mb = peak\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    cmd = [sys.executable, str(probe), os.path.join(ROOT, "benchmarks", "grid.py"), "chunk_gla", "--quick",
           "--device", "cpu", "--no-fla", "--modes", "fwd", "--out", str(tmp_path),
           "--autotune-cache", str(cache)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "benchmarks"),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=300)
    assert 'restored {"configs": 1}' in out.stdout
    assert "kept 2 autotuning results" in out.stdout
    assert sorted(p.name for p in cache.iterdir()) == ["cpu.autotune.json"]
    assert json.loads((cache / "cpu.autotune.json").read_text()) == {
        "abc123/chunk_fwd_kernel.autotune.json": '{"configs": 1}', "def456/new.autotune.json": "{}"}


def test_ab_builds_usage():
    """ab_builds.sh needs a GPU to measure; here: it parses, and without cases prints its usage
    (the revision or folder, then the kernel_times.py cases) and exits 2 before building."""
    script = os.path.join(ROOT, "benchmarks", "ab_builds.sh")
    subprocess.run(["bash", "-n", script], check=True, timeout=60)
    r = subprocess.run(["bash", script, "HEAD"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "REV|DIR" in r.stdout and "kernel_times.py" in r.stdout


def test_operand_precision_quick_cpu(tmp_path):
    """benchmarks/operand_precision.py: its chunked RWKV7 algebra with exact products matches the
    float64 oracle (the final state and dh0 to their fp32 rounding: the outputs and gradients are
    bf16, so their error is bf16's); rounding the products' operands to TF32, then bf16, adds error
    in that order; fp16 operands scaled by powers of two (per row / column, or per tile) stay at
    TF32's error, below bf16's."""
    out = tmp_path / "prec.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "operand_precision.py"), "--T", "48", "--H", "1",
           "--K", "8", "--w", "rwkv7", "--lr", "iclr1", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    err = {(r["fmt"], r["out"]): r["rel"] for r in rows}
    assert len(rows) == 7 * 9
    assert err["exact", "ht"] < 1e-7 and err["exact", "dh0"] < 1e-7
    assert all(err["exact", n] < 5e-3 for n in ("o", "dr", "dw", "dk", "dv", "da", "db"))
    assert err["exact", "ht"] < err["tf32", "ht"] < err["bf16", "ht"]
    for fmt in ("fp16s", "fp16t"):
        assert err["exact", "ht"] < err[fmt, "ht"] < 2 * err["tf32", "ht"] < err["bf16", "ht"]


def test_fp16_scaled_operands():
    """operand_precision.fp16_scaled: each slice divided by a power of two at or above its largest
    magnitude, rounded to fp16, multiplied back: 11 significant bits down to 2^-14 of the slice's
    largest entry (TF32's), an absolute error of at most 2^-25 of it below; no overflow whatever
    the magnitude, zeros stay zeros."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import torch
    from operand_precision import fp16_scaled
    x = torch.tensor([[3e30, -1.0e30, 7.0e26, 2.5e16, 0.0],
                      [1e-30, 3e-31, -5e-35, 1e-40, 0.0]], dtype=torch.float64)
    for dims in (-1, (-2, -1)):
        y = fp16_scaled(x, dims)
        amax = x.abs().amax(dim=dims, keepdim=True)
        big = x.abs() >= amax * 2.0 ** -14
        assert torch.isfinite(y).all() and (y[x == 0] == 0).all()
        assert ((y - x).abs() <= x.abs() * 2.0 ** -11)[big].all()
        assert ((y - x).abs() <= amax * 2.0 ** -25)[~big].all()
    assert fp16_scaled(x, -1)[1, 0] != 0 and fp16_scaled(x, (-2, -1))[1, 0] == 0  # one scale per tile


def test_grid_run_names_the_sources(tmp_path):
    """A row's run carries the digest of the sources built (a GPU machine may run a working tree
    whose git HEAD lags it): `--source-digest` prints the same for the checkout; the digest
    follows a source's content, not what a build writes (fla_ext/_build_info.py)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import grid
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = os.path.join(ROOT, "benchmarks", "grid.py")
    digest = subprocess.run([sys.executable, script, "--source-digest"], check=True, env=env,
                            capture_output=True, text=True, timeout=300).stdout.strip()
    assert len(digest) == 12 and digest == grid.source_digest()
    subprocess.run([sys.executable, script, "chunk_gla", "--quick", "--device", "cpu", "--no-fla",
                    "--modes", "fwd", "--out", str(tmp_path)], check=True, env=env, capture_output=True,
                   timeout=300)
    (row,) = json.loads((tmp_path / "cpu_chunk_gla_grid.json").read_text())["rows"]
    assert row["run"].endswith(f"src:{digest}")
    tree = tmp_path / "tree"
    (tree / "csrc").mkdir(parents=True)
    (tree / "fla_ext").mkdir()
    (tree / "setup.py").write_text("setup()\n")
    (tree / "csrc" / "op.cu").write_text("a\n")
    (tree / "fla_ext" / "ops.py").write_text("b\n")
    first = grid.source_digest(str(tree))
    (tree / "fla_ext" / "_build_info.py").write_text("TORCH_VERSION = 'x'\n")
    assert grid.source_digest(str(tree)) == first
    (tree / "csrc" / "op.cu").write_text("a2\n")
    assert grid.source_digest(str(tree)) != first


SASS = """
	code for sm_90a
		Function : _ZN3fla12chunk_detail6kernelEv
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   LDS R4, [R2] ;                          /* 0x0000000002047984 */
        /*0020*/                   VIADD R4, R4, 0x1000 ;                  /* 0x0000100004047836 */
        /*0030*/                   HMMA.1688.F32.TF32 R8, R4, R6, R8 ;     /* 0x000000060408723c */
        /*0040*/              @!P0 BRA 0x10 ;                              /* 0xfffffffc00008947 */
        /*0050*/                   STG.E [R2.64], R8 ;                     /* 0x0000000802007986 */
        /*0060*/                   EXIT ;                                  /* 0x000000000000794d */
		Function : _ZN3fla5otherEv
        /*0000*/                   IADD3 R1, R1, 0x1000, RZ ;              /* 0x0000100001017810 */
        /*0010*/                   IADD3 R1, R1, 0x2000, RZ ;              /* 0x0000200001017810 */
        /*0020*/                   EXIT ;                                  /* 0x000000000000794d */
"""


def test_sass_counts_reads_kernels_and_loops():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import sass_counts
    funcs = sass_counts.parse_functions(SASS)
    assert list(funcs) == ["_ZN3fla12chunk_detail6kernelEv", "_ZN3fla5otherEv"]
    k = funcs["_ZN3fla12chunk_detail6kernelEv"]
    assert sass_counts.counts(k) == {"instr": 7, "hmma": 1, "lds": 1, "sts": 0, "ldg": 0, "stg": 1,
                                     "mufu": 0, "tf32_round": 1}
    # the predicated branch back to 0x10 closes a loop over LDS, the rounding add and the HMMA
    (j, i, c), = sass_counts.mma_loops(k)
    assert (j, i, c["instr"], c["hmma"], c["lds"], c["tf32_round"]) == (1, 4, 4, 1, 1, 1)
    other = funcs["_ZN3fla5otherEv"]
    assert sass_counts.counts(other)["tf32_round"] == 1  # 0x2000 is not a TF32 rounding add
    assert sass_counts.mma_loops(other) == []
    assert sass_counts.short_name("_ZN3fla12chunk_detail6kernelEv") == "kernelEv"
