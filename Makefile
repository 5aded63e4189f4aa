# theanompi: every target depends on `venv`, so `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TMPI   := $(BIN)/tmpi

N        ?= 2
RULE     ?= BSP
STRATEGY ?= ar
MODEL    ?= digits
CONFIG   ?= configs/config.yaml
DATA     ?= data/digits
IMAGENET ?=
RUN      ?=
RESUME   ?=
OVERWRITE ?=

# make train's run dir (unless RUN=DIR): one per model, rule, strategy and N, so that runs
# of different ones never meet. RESUME=1 continues it (--resume), OVERWRITE=1 replaces it.
RUN_NAME   = runs/$(basename $(notdir $(MODEL)))-$(RULE)-$(STRATEGY)-n$(N)
TRAIN_RUN  = $(or $(RUN),$(RUN_NAME))
# make eval's run: RUN; else the one RULE, STRATEGY or N given to make name; else the latest
# run of MODEL (the newest checkpoint under runs/MODEL-*), e.g. what make train just wrote.
NAMED      = $(filter-out default file,$(origin RULE) $(origin STRATEGY) $(origin N))
LATEST_RUN = $(patsubst %/checkpoints/,%,$(dir $(firstword $(shell ls -t \
               runs/$(basename $(notdir $(MODEL)))-*/checkpoints/epoch_*.npz 2>/dev/null))))
EVAL_RUN   = $(or $(RUN),$(if $(NAMED),$(RUN_NAME),$(or $(LATEST_RUN),$(RUN_NAME))))

.PHONY: venv constraints data train eval demo test test-suite test-quick test-mpi test-slurm bench bench-prep bench-exchange bench-model bench-train bench-startup bench-cluster lint clean

venv: $(STAMP)

# Versions pinned by constraints.txt (the tested set; `make constraints` refreshes it).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

constraints: venv
	{ sed -n '1,2p' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable \
	  | grep -v '^theanompi' | sed 's/+[a-z0-9.]*$$//'; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt

data: venv
ifeq ($(IMAGENET),)
	$(TMPI) prep demo --out data/digits_tree
	$(TMPI) prep all -n $(N) --src data/digits_tree --out $(DATA) --size 32
else
	$(TMPI) prep all -n $(N) --src $(IMAGENET) --out $(DATA)
endif

train: venv
	$(TMPI) train -n $(N) --config $(CONFIG) --model $(MODEL) --rule $(RULE) --strategy $(STRATEGY) \
	  --data $(DATA) --run-dir $(TRAIN_RUN)$(if $(filter 1,$(RESUME)), --resume)$(if $(filter 1,$(OVERWRITE)), --overwrite)

eval: venv
	$(TMPI) eval -n $(N) --config $(CONFIG) --model $(MODEL) --data $(DATA) --run-dir $(EVAL_RUN)

# make demo owns make train's default run: run again, it finds the run trained and evaluates
# it again (RESUME=1: nothing left to train; an interrupted one trains to its end)
demo: RESUME = $(if $(wildcard $(TRAIN_RUN)/checkpoints/epoch_*.npz),1)
demo: data train eval

# Bytecode written (an empty PYTHONDONTWRITEBYTECODE is unset): where the environment sets it,
# pytest rewrote every test module again in each of its processes (collection 17-26 s -> 5 s)
# and each of the suite's hundreds of processes compiled our sources again.
PYTEST := env PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -p no:cacheprovider --color=no
MPIRUN := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 $(BIN)/mpirun --bind-to none

# The exchange tests also run inside a 2-rank job (each rank a pytest process; rank 1 quiet),
# then the whole suite, its MPI tests launching real mpirun jobs themselves: JOBS pytest-xdist
# workers (one per core) share the tests, then the `serial` ones (namespaces, Slurm, faults
# timed in seconds from a start) run alone. `make test-quick`: the suite without the slow and serial ones.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
test: test-mpi test-suite

test-suite: venv
	$(PYTEST) -n $(JOBS) --dist worksteal -m "not serial" --durations 15
	$(PYTEST) -m serial --durations 8

test-quick: venv
	$(PYTEST) -n $(JOBS) --dist worksteal -m "not serial and not slow"

# The simulated Slurm cluster's tests (root; installs slurm-wlm and munge where missing), with
# the `scancel --signal=USR1 --full` one that `make test` skips (docs/cluster.md#slurm)
test-slurm: venv
	$(PYTEST) tests/cluster/test_slurm.py tests/launch/test_slurm.py

test-mpi: venv
	$(MPIRUN) -n 2 sh -c 'if [ "$$OMPI_COMM_WORLD_RANK" = 0 ]; then exec $(PYTEST) tests/exchange; \
	  else exec $(PYTEST) tests/exchange >/dev/null; fi'

bench: bench-prep bench-exchange bench-model bench-train bench-startup

bench-prep: venv
	$(TMPI) bench prep

bench-exchange: venv
	$(TMPI) bench exchange

bench-model: venv
	$(TMPI) bench model

bench-train: venv
	$(TMPI) bench train

bench-startup: venv
	$(TMPI) bench startup

# root only: two network namespaces on a shaped 1 Gbit veth (issue 29); not part of `make bench`
bench-cluster: venv
	$(TMPI) bench cluster

lint: venv
	$(BIN)/ruff check theanompi prep pipelines tests
	$(BIN)/ruff format --check theanompi prep pipelines tests
	$(BIN)/lint-imports

clean:
	rm -rf data runs bench_out
