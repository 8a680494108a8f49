"""benchmarks/grid.py runs end to end (one tiny point on the CPU) and writes the rows the issues
ask for, merged into an existing file row by row."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_grid_quick_cpu(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "grid.py"), "chunk_rwkv7", "--quick",
           "--device", "cpu", "--no-fla", "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for _ in range(2):  # the second run replaces the first one's rows
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    rows = json.loads((tmp_path / "cpu_chunk_rwkv7_grid.json").read_text())["rows"]
    assert sorted(r["mode"] for r in rows) == ["fwd", "fwd_nograd", "fwdbwd"]
    for r in rows:
        assert {"op", "impl", "gpu", "B", "T", "H", "K", "V", "dtype", "mode", "ms", "peak_mib"} <= set(r)
        assert r["impl"] == "fla_ext" and r["ms"] > 0
