PY := .venv/bin/python
STACK := scripts/setup_venv.sh requirements.txt pyproject.toml

.PHONY: demo test bench clean-venv

.venv/.installed: $(STACK)
	bash scripts/setup_venv.sh

demo: .venv/.installed
	$(PY) examples/quickstart.py

test: .venv/.installed
	$(PY) -m pytest -q tests

bench: .venv/.installed
	$(PY) benchmarks/embedding_step.py

clean-venv:
	rm -rf .venv
