# seqfuse: the two commands a fresh machine needs, and the developer targets.
#   make run    installs what is missing, builds, and runs the main job
#   make test   installs what is missing, builds, and runs the tests
PYTHON ?= python3

.PHONY: run test deps build kernels gpu-check clean

deps:
	$(PYTHON) -m pip install -q -r requirements-test.txt

build: deps
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .

run: build
	$(PYTHON) -m seqfuse

test: build
	$(PYTHON) -m pytest -q tests

# Standalone kernel checks (C + CUDA, no Python), built here for sm_90a and
# carried to the GPU machine: csrc/<family>/check_*.cu -> bin/.
kernels:
	bash csrc/build_checks.sh

gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf build bin python/seqfuse/*.so *.egg-info python/*.egg-info
