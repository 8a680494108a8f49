# The README's commands. `demo` and `test` set themselves up from a fresh clone (virtual env,
# pinned torch, build); `gpu-check` and `bench` use the system python of a GPU machine as is.
PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
TORCH_PIN   ?= torch==2.14.1
MAX_JOBS    ?= 2
export MAX_JOBS
# The in-place build lives in the repo: scripts under examples/ and benchmarks/ import it from here.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))


.PHONY: demo test build pytest cpp-test gpu-check bench sanitize clean

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" pytest ninja numpy expecttest matplotlib tqdm "transformers==5.24.0"
	touch $@

# In-place build: ninja keeps it incremental. (`pip install --no-build-isolation -e .` also works.)
build: $(VENV)/.deps
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) setup.py -q build_ext --inplace
	@# the venv's python finds the in-place package without PYTHONPATH (examples, your scripts)
	@$(PY) -c "import os, site; open(os.path.join(site.getsitepackages()[0], 'fla_ext_dev.pth'), 'w').write('$(CURDIR)\n')"

demo: build
	$(PY) examples/demo.py

test: pytest cpp-test

pytest: build
	FLA_EXT_POISON=1 $(PY) -m pytest -q tests

cpp-test: build
	PYTHON=$(PY) PATH="$(abspath $(VENV))/bin:$$PATH" bash tests/cpp/run.sh

# On a GPU machine with torch installed and the extension built (pip install -e .):
gpu-check:
	FLA_EXT_POISON=1 $(PYTHON) -m pytest -q -m cuda tests
	$(PYTHON) benchmarks/bench_ops.py

bench:
	$(PYTHON) benchmarks/bench_ops.py

clean:
	rm -rf build fla_ext/_C*.so *.egg-info

# On a GPU machine (the CUDA toolkit's compute-sanitizer; torch and the built extension in
# $(PYTHON)): memcheck over every op and case of tests/sanitize.py (each tensor its own allocation,
# so an access outside one is seen), initcheck over its well-formed cases (outputs not poisoned, so
# a read of memory no kernel wrote is seen; malformed boundaries leave rows of o unwritten by
# design), and racecheck (shared memory) on its small set.
SANITIZER ?= compute-sanitizer
sanitize:
	PYTORCH_NO_CUDA_MEMORY_CACHING=1 $(SANITIZER) --tool memcheck --error-exitcode 1 $(PYTHON) tests/sanitize.py --set full
	PYTORCH_NO_CUDA_MEMORY_CACHING=1 FLA_EXT_POISON=0 $(SANITIZER) --tool initcheck --error-exitcode 1 $(PYTHON) tests/sanitize.py --set valid
	$(SANITIZER) --tool racecheck --error-exitcode 1 $(PYTHON) tests/sanitize.py --set small
