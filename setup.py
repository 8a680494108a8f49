"""Build fla_ext._C: CUDA kernels when torch has CUDA and nvcc is found, CPU-only otherwise.

Knobs (environment):
  FLA_EXT_BUILD_CUDA=0/1   force the CPU-only or the CUDA build
  TORCH_CUDA_ARCH_LIST     GPU targets (default "8.0;8.6;8.9;9.0+PTX"; "9.0a" for Hopper only)
  MAX_JOBS                 parallel compile jobs (ninja)
  FLA_EXT_DEBUG=1          -O0 -g host code and -G device code
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup



def _cuda_home_hint() -> None:
    # torch guesses CUDA_HOME as the parent of the `nvcc` on PATH; a wrapper script such as
    # /usr/local/bin/nvcc then yields /usr/local, which has no CUDA headers.
    if "CUDA_HOME" in os.environ or "CUDA_PATH" in os.environ:
        return
    nvcc = shutil.which("nvcc")
    guess = os.path.dirname(os.path.dirname(nvcc)) if nvcc else None
    header = "include/cuda_runtime_api.h"
    if (guess is None or not os.path.exists(os.path.join(guess, header))) and os.path.exists(
            os.path.join("/usr/local/cuda", header)):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"


_cuda_home_hint()

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as e:  # pragma: no cover - exercised only on broken setups
    sys.exit(
        f"fla_ext: building needs PyTorch ({e}; python: {sys.executable}). Install torch into "
        "this python first, then `python -m pip install --no-build-isolation -e .`."
    )

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    forced = os.environ.get("FLA_EXT_BUILD_CUDA")
    if forced is not None:
        if forced == "1" and (torch.version.cuda is None or cpp_extension.CUDA_HOME is None):
            sys.exit("fla_ext: FLA_EXT_BUILD_CUDA=1 but torch has no CUDA or nvcc was not found")
        return forced == "1"
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def _links_shared_libstdcxx(cxx: str) -> bool:
    try:
        out = subprocess.run(cxx.split() + ["-print-file-name=libstdc++.so"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    return os.path.isabs(out) and os.path.exists(out)


def use_shared_libstdcxx_toolchain() -> None:
    """Make sure the extension links the shared libstdc++ that the process loads.

    The GPU image exports CC/CXX=/opt/gcc/..., a compiler that finds no shared libstdc++ and
    links its pieces statically: the extension then carries private locale facets that the
    process never initialised, and every error message that formats a number segfaulted. When the
    configured compiler is like that, use the g++ on PATH instead.
    """
    configured = os.environ.get("CXX") or (sysconfig.get_config_var("CXX") or "g++")
    if _links_shared_libstdcxx(configured):
        return
    for gxx in (shutil.which("g++"), "/usr/bin/g++"):
        if gxx and _links_shared_libstdcxx(gxx):
            gcc = os.path.join(os.path.dirname(gxx), "gcc")
            os.environ.update(CC=gcc if os.path.exists(gcc) else gxx, CXX=gxx, LDSHARED=f"{gxx} -shared")
            print(f"fla_ext: {configured} links no shared libstdc++; building with {gxx}")
            return


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def extension():
    use_shared_libstdcxx_toolchain()
    cuda = want_cuda()
    debug = os.environ.get("FLA_EXT_DEBUG") == "1"
    sources = rel("csrc/registration.cpp") + rel("csrc/ops/*.cpp") + rel("csrc/cpu/*.cpp")
    cxx = ["-O0" if debug else "-O3"] + (["-g"] if debug else [])
    args = {"cxx": cxx}
    if cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;8.6;8.9;9.0+PTX")
        sources += rel("csrc/cuda/*.cpp") + rel("csrc/kernels/*.cu")
        args["nvcc"] = ["-O3", "-lineinfo", "--expt-relaxed-constexpr",
                        "-Xptxas=-warn-spills"] + (["-G"] if debug else [])
        ext = cpp_extension.CUDAExtension
    else:
        ext = cpp_extension.CppExtension
    print(f"fla_ext: building {'CUDA' if cuda else 'CPU-only'} extension"
          + (f" for {os.environ['TORCH_CUDA_ARCH_LIST']}" if cuda else ""))
    return ext("fla_ext._C", sources, extra_compile_args=args, include_dirs=[os.path.join(ROOT, "csrc")])


def version() -> str:
    with open(os.path.join(ROOT, "fla_ext", "_version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


class BuildExtension(cpp_extension.BuildExtension):
    """Also records the torch the library is built against (fla_ext/_build_info.py), so that an
    import under another torch fails with a message that says so instead of a missing symbol."""

    def run(self):
        super().run()
        info = (f'"""Written by setup.py at build time."""\n'
                f'TORCH_VERSION = "{torch.__version__}"\n'
                f'CUDA_VERSION = {torch.version.cuda!r}\n')
        dirs = {os.path.join(ROOT, "fla_ext")} if self.inplace else set()
        dirs.add(os.path.join(self.build_lib, "fla_ext"))
        for d in dirs:
            if os.path.isdir(d):
                with open(os.path.join(d, "_build_info.py"), "w") as f:
                    f.write(info)


setup(
    name="fla_ext",
    version=version(),
    packages=find_packages(include=["fla_ext", "fla_ext.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
