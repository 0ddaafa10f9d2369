# Two entry points, both self-installing into ./.venv (CPU torch wheel, never a CUDA build):
#   make demo   capture + replay + report of the embedded CPU demo model
#   make test   the test suite (what .ci/run and CI call)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

$(BIN)/cbtrace: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 tensordict==0.15.3 \
	    pyvers==0.2.3 cloudpickle==3.1.3 pyre-extensions==0.0.32 typing-inspect==0.9.0 \
	    mypy-extensions==1.2.0 || echo "torchrec not installed: its tests will skip"
	touch $(BIN)/cbtrace

install: $(BIN)/cbtrace

demo: install
	$(BIN)/cbtrace demo --out runs/demo-$$(date +%Y%m%d-%H%M%S)

test: install
	bash scripts/ensure_chromium.sh
	$(BIN)/python -m pytest -m "not gpu" -q

.PHONY: install demo test
