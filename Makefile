PY := .venv/bin/python
STACK := scripts/setup_venv.sh requirements.txt pyproject.toml

.PHONY: demo test soak lint bench clean-venv

.venv/.installed: $(STACK)
	bash scripts/setup_venv.sh

# DeepFM + CowClip at batch 16K on 2M rows of built-in synthetic Criteo-like data
# (generated into data_cache/ on first use; a re-run replaces runs/demo); about 3 minutes
# on a 2-core AMD EPYC VM.
demo: .venv/.installed
	$(PY) -m torchrec_cowclip train --model deepfm --data synthetic:2000000 \
		--batch-size 16384 --epochs 2 --out runs/demo --overwrite

# Lint, format check and types (pyproject.toml: [tool.ruff], [tool.mypy]), then the test
# suite and every docstring example (>>>) in the package.
test: lint
	$(PY) -m pytest -q -m "not slow" --doctest-modules tests torchrec_cowclip

# The slow soak (README, Reliability): two processes under torchrun --max-restarts, 10
# SIGKILLs of a random rank, final metrics and logs equal to the uninterrupted run's;
# 1.5-3 minutes on a 2-core VM.
soak: .venv/.installed
	$(PY) -m pytest -q -s -m slow tests/test_soak.py

lint: .venv/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

bench: .venv/.installed
	$(PY) benchmarks/embedding_step.py

clean-venv:
	rm -rf .venv
