# Two commands for a new user: `make train` and `make test`. Each creates .venv on first use (pinned
# requirements; torch==2.13.0, the CPU build, unless a torch is already importable there or TORCH names another,
# e.g. `make train TORCH=torch==2.11.0`) and is quick once it exists.
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test clean

setup: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -r requirements.txt
	@touch $(STAMP)

# The embedded default: a tiny Wan 2.1 on a small synthetic mixed image/video corpus, on the CPU.
# Extra Hydra overrides: `make train ARGS="train.steps=50 conf=..."`.
train: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/python train.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests $(ARGS)

clean:
	rm -rf runs outputs .cache
