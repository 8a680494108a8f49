#!/usr/bin/env bash
# Configure, build and run the C++ tests (CMakeLists.txt) in build/cpp with Ninja.
#
#   PYTHON=.venv/bin/python bash tests/cpp/run.sh [extra cmake args, e.g. -DFLA_EXT_CUDA=ON]
#
# PYTHON (default python3) is the python whose torch is built against: its
# torch.utils.cmake_prefix_path becomes CMAKE_PREFIX_PATH. MAX_JOBS (default 2) build jobs;
# BUILD_DIR (default build/cpp) the build folder. Ninja is taken from PATH, else from beside
# $PYTHON (a venv's bin/), else from the pip `ninja` package of $PYTHON.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/cpp}"
JOBS="${MAX_JOBS:-2}"

if ! prefix="$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')"; then
  echo "tests/cpp/run.sh: '$PYTHON' cannot import torch; set PYTHON to a python with torch" >&2
  exit 1
fi

ninja_bin="$(command -v ninja || true)"
if [[ -z "$ninja_bin" ]]; then
  py_path="$(command -v "$PYTHON" || echo "$PYTHON")"
  if [[ -x "$(dirname "$py_path")/ninja" ]]; then
    ninja_bin="$(dirname "$py_path")/ninja"
  else
    ninja_bin="$("$PYTHON" -c 'import ninja, os; print(os.path.join(ninja.BIN_DIR, "ninja"))' \
                 2>/dev/null || true)"
  fi
fi
if [[ -z "$ninja_bin" || ! -x "$ninja_bin" ]]; then
  echo "tests/cpp/run.sh: ninja not found (PATH, beside $PYTHON, or pip's ninja)" >&2
  exit 1
fi

args=(-S "$ROOT" -B "$BUILD_DIR" -DCMAKE_PREFIX_PATH="$prefix")
# The generator can only be chosen when the build folder is first configured.
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then
  args+=(-G Ninja -DCMAKE_MAKE_PROGRAM="$ninja_bin")
fi
# The Makefile exports CXX="ccache g++"; CMake wants the launcher apart from the compiler.
if [[ "${CXX:-}" == ccache\ * ]]; then
  export CXX="${CXX#ccache }"
  args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
if [[ "${CC:-}" == ccache\ * ]]; then export CC="${CC#ccache }"; fi

echo "+ cmake ${args[*]} $*"
cmake "${args[@]}" "$@"
echo "+ cmake --build $BUILD_DIR -j $JOBS"
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "+ ctest --test-dir $BUILD_DIR --output-on-failure"
ctest --test-dir "$BUILD_DIR" --output-on-failure
