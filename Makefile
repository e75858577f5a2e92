# Two commands for a newcomer:  `make demo` (the main job on the embedded default) and `make test`
# (or `make test-quick` first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned to a build that exists for this Python: an unpinned torch may pull
# gigabytes of CUDA packages. On a GPU machine, override: make demo TORCH="torch==2.13.0".
TORCH ?= torch==2.13.0
DEMO := data/pystdlib

.PHONY: install demo test test-quick lint clean-demo

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/.installed

# Real text that needs no download (this Python's own standard library), a BPE tokenizer trained
# on it, the .bin/.idx dataset, then a tiny GPT-NeoX trained on 2 CPU ranks (or the local GPUs).
# Each step runs once; a second `make demo` resumes training from the last checkpoint.
$(DEMO)/pystdlib.jsonl.zst: | $(BIN)/.installed
	$(BIN)/python tools/prepare_data.py pystdlib

$(DEMO)/tokenizer.json: $(DEMO)/pystdlib.jsonl.zst
	$(BIN)/python tools/train_tokenizer.py $< --vocab-size 2048 --output $@

$(DEMO)/pystdlib_text_document.idx: $(DEMO)/tokenizer.json
	$(BIN)/python tools/preprocess_data.py --input $(DEMO)/pystdlib.jsonl.zst --output-prefix $(DEMO)/pystdlib --tokenizer-type HFTokenizer --vocab-file $< --append-eod --workers 2 --overwrite

# Then the whole path after training: evaluate, generate, export to Hugging Face and check that
# transformers loads the export and computes the same logits and greedy tokens as neox.
RUN_CFG = configs/tiny.yml $$($(BIN)/python -c "import torch; print('' if torch.cuda.is_available() else 'configs/cpu.yml')")
demo: install $(DEMO)/pystdlib_text_document.idx
	@echo "== demo 1/4: train the tiny model (resumes from checkpoints/tiny if it holds a checkpoint)"
	$(BIN)/python deepy.py train.py $(RUN_CFG)
	@echo "== demo 2/4: evaluate: perplexity and bits per byte on the test split"
	$(BIN)/python deepy.py eval.py $(RUN_CFG) configs/demo/eval.yml
	@echo "== demo 3/4: generate: continue the prompts of configs/demo/prompts.txt"
	$(BIN)/python deepy.py generate.py $(RUN_CFG) configs/demo/generate.yml
	@$(BIN)/python -c "import json; [print(repr(r['context']), '->', repr(r['text'])) for r in map(json.loads, open('logs/tiny/samples.jsonl'))]"
	@echo "== demo 4/4: export to Hugging Face format (hf/tiny) and check it with transformers"
	$(BIN)/python tools/convert_to_hf.py --input_dir checkpoints/tiny --output_dir hf/tiny --overwrite --verify

# Two pytest-xdist workers (2-core CI); tests/conftest.py groups the tests that share a fixture.
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25

# A newcomer's first check, about 2 minutes: the in-process tests of the configs and tokenizers,
# and the demo's stages through deepy.py (tests/test_demo.py).
QUICK_TESTS = tests/config tests/tokenizer tests/test_console.py tests/test_demo.py
test-quick: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(QUICK_TESTS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean-demo:
	rm -rf $(DEMO) checkpoints/tiny logs/tiny tensorboard/tiny hf/tiny
