# Commands for a new user: `make train`, `make test-fast` (while editing) and `make test` (the full suite, as CI runs
# it). Each creates .venv on first use (pinned requirements) and is quick once it exists. Where .venv has no torch,
# TORCH (torch==2.13.0) comes from PyTorch's CPU wheel index, TORCH_INDEX: pip's default index would bring the
# multi-GB CUDA build on Linux. Where that index cannot be reached, the plain pin is installed from pip's configured
# index, with a message. A torch already importable there is kept; TORCH names another: `make train TORCH=torch==2.11.0`.
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup train test test-fast clean

setup: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if $(BIN)/python -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/torch/', timeout=10)" 2>/dev/null \
	     && $(BIN)/python -m pip install -q --timeout 30 --index-url $(TORCH_INDEX) "$(TORCH)"; then :; \
	  else \
	    echo "make setup: PyTorch's CPU wheel index ($(TORCH_INDEX)) cannot be reached or lacks $(TORCH);" \
	         "installing $(TORCH) from pip's configured index instead (on Linux that may be a CUDA build)"; \
	    $(BIN)/python -m pip install -q "$(TORCH)" || exit 1; \
	  fi; \
	  $(BIN)/python -W ignore -c "import torch; print('make setup: torch', torch.__version__, 'CPU build' if torch.version.cuda is None else 'CUDA ' + torch.version.cuda + ' build')"; \
	fi
	$(BIN)/python -m pip install -q -r requirements.txt
	@touch $(STAMP)

# The embedded default: a tiny Wan 2.1 on a small synthetic mixed image/video corpus, on the CPU.
# Extra Hydra overrides: `make train ARGS="train.steps=50 conf=..."`.
train: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/python train.py $(ARGS)

# The tests' own packages (requirements-test.txt: pytest, pytest-xdist, and triton for the kernels' interpreter), on
# top of setup.
$(TEST_STAMP): $(STAMP) requirements-test.txt
	$(BIN)/python -m pip install -q -r requirements-test.txt
	@touch $(TEST_STAMP)

# The whole suite (CI: .ci/run): every test, the slow model, script and multi-process ones included.
# Both spread the tests over TEST_WORKERS processes (pytest-xdist): 2, the development machine's cores, by default;
# `make test TEST_WORKERS=auto` takes every core, TEST_WORKERS=0 runs them in this one process. The tests marked
# serial (pytest.ini: they assert wall-clock or busy time) then run alone; pytest's status 5 (none selected) passes.
TEST_WORKERS ?= 2
SERIAL = || test $$? -eq 5
test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not serial" tests $(ARGS) $(SERIAL)
	$(BIN)/python -m pytest -q -m serial tests $(ARGS) $(SERIAL)

# Every package's tests but those marked slow (pytest.ini): the lane to run while editing.
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow and not serial" tests $(ARGS) $(SERIAL)
	$(BIN)/python -m pytest -q -m "not slow and serial" tests $(ARGS) $(SERIAL)

clean:
	rm -rf runs outputs .cache
