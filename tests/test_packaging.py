"""Packaging: the source distribution carries every file a build reads (C++ / CUDA sources and
headers, CMake, LICENSE, README), the version has one source, and an import under another torch
than the library was built against fails with a message naming both."""
import glob
import os
import subprocess
import sys
import tarfile
import types

import pytest

import fla_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sdist_carries_the_sources(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True, timeout=600,
                   env=dict(os.environ, FLA_EXT_BUILD_CUDA="0"))
    (sdist,) = glob.glob(str(tmp_path / "fla_ext-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    sources = [os.path.relpath(p, ROOT) for ext in ("h", "cuh", "cpp", "cu")
               for p in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext}"), recursive=True)]
    assert len(sources) > 60
    missing = sorted(set(sources) - names)
    assert not missing, f"not in the sdist: {missing}"
    for f in ("LICENSE", "README.md", "CMakeLists.txt", "setup.py", "pyproject.toml",
              "fla_ext/_version.py", "fla_ext/cp.py"):
        assert f in names, f
    assert not [n for n in names if n.endswith(".so") or n.endswith("_build_info.py")]


def test_one_version():
    from fla_ext._version import __version__
    assert fla_ext.__version__ == __version__
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'dynamic = ["version"]' in f.read()


def test_torch_mismatch_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla_ext._build_info",
                        types.SimpleNamespace(TORCH_VERSION="1.13.0+cu117", CUDA_VERSION="11.7"))
    with pytest.raises(ImportError, match=r"built against torch 1\.13\.0\+cu117.*rebuild"):
        fla_ext._check_torch()
