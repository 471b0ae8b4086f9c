PY := .venv/bin/python
STACK := scripts/setup_venv.sh requirements.txt pyproject.toml

.PHONY: demo test bench clean-venv

.venv/.installed: $(STACK)
	bash scripts/setup_venv.sh

# DeepFM + CowClip at batch 16K on 2M rows of built-in synthetic Criteo-like data
# (generated into data_cache/ on first use); about 3 minutes on 2 cores.
demo: .venv/.installed
	$(PY) -m torchrec_cowclip train --model deepfm --data synthetic:2000000 \
		--batch-size 16384 --epochs 2 --out runs/demo

# The test suite and every docstring example (>>>) in the package.
test: .venv/.installed
	$(PY) -m pytest -q --doctest-modules tests torchrec_cowclip

bench: .venv/.installed
	$(PY) benchmarks/embedding_step.py

clean-venv:
	rm -rf .venv
