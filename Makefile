# seqfuse: the two commands a fresh machine needs, and the developer targets.
#   make run    installs what is missing, builds, and runs the main job
#   make test   installs what is missing, builds, and runs the tests
PYTHON ?= python3

.PHONY: run test deps build kernels gpu-check clean

deps:
	$(PYTHON) -m pip install -q -r requirements-test.txt

build: deps
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .

# The main job: the ESM-2 masked-LM recipe (recipes/esm2) at its L0_sanity size
# on real UniProt proteins (the committed subset): trains about a minute on a
# CPU (seconds on a GPU), checkpoints and exports a Hugging Face model under
# runs/.  More: make run ARGS="train.steps=200 precision.recipe=fp8_delayed",
# other sizes: python recipes/esm2/train_fsdp2.py --config 35M (see recipes/esm2).
RUN_DIR ?= runs/esm2_L0_sanity
run: build
	$(PYTHON) -m seqfuse
	$(PYTHON) recipes/esm2/train_fsdp2.py --config L0_sanity checkpoint.dir=$(RUN_DIR)/checkpoints \
		checkpoint.export_dir=$(RUN_DIR)/hf checkpoint.resume=false $(ARGS)

# Two pytest workers (pytest-xdist), one CPU thread each: CI's 2-core machine.  Whole
# files per worker (--dist loadfile): a module's fixtures (some start process groups) run once.
TEST_WORKERS ?= 2
test: build
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# Standalone kernel checks (C + CUDA, no Python), built here for sm_90a and
# carried to the GPU machine: csrc/<family>/check_*.cu -> bin/.
kernels:
	bash csrc/build_checks.sh

gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf build bin python/seqfuse/*.so *.egg-info python/*.egg-info
