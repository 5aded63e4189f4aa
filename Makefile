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
RUN      ?= runs/$(MODEL)

.PHONY: venv data train eval demo test test-serial test-mpi bench bench-prep bench-exchange bench-model bench-train lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]' --config-settings editable_mode=compat
	touch $(STAMP)

data: venv
ifeq ($(IMAGENET),)
	$(TMPI) prep demo --out data/digits_tree
	$(TMPI) prep all -n $(N) --src data/digits_tree --out $(DATA) --size 32
else
	$(TMPI) prep all -n $(N) --src $(IMAGENET) --out $(DATA)
endif

train: venv
	$(TMPI) train -n $(N) --config $(CONFIG) --model $(MODEL) --rule $(RULE) --strategy $(STRATEGY) --data $(DATA) --run-dir $(RUN)

eval: venv
	$(TMPI) eval -n $(N) --config $(CONFIG) --model $(MODEL) --data $(DATA) --run-dir $(RUN)

demo: data train eval

test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: bench-prep bench-exchange bench-model bench-train

bench-prep: venv
	$(TMPI) bench prep

bench-exchange: venv
	$(TMPI) bench exchange

bench-model: venv
	$(TMPI) bench model

bench-train: venv
	$(TMPI) bench train

lint: venv
	$(BIN)/ruff check theanompi prep pipelines tests
	$(BIN)/ruff format --check theanompi prep pipelines tests

clean:
	rm -rf data runs bench_out
