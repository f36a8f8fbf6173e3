# make run   - the demo: three regions, serve, a load generator (Ctrl-C stops it)
# make test  - lint (ruff), type-check (mypy) and the whole pytest suite
# Both set up .venv themselves on a fresh Debian machine with Python 3.11.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUNTIME := $(VENV)/.runtime-stamp
STAMP  := $(VENV)/.installed-stamp

.PHONY: run simulate test lint typecheck programs compiler browser unit fast pure bench clean

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  echo "python3 -m venv failed; installing Debian's python3-venv"; \
	  apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install -q --upgrade pip

# the demo needs the runtime dependencies only; the tests add their tools.
# Installing compiles the C readers of the L7 fast path and the HTTP checks
# (hatch_build.py) when the machine has a C compiler and Python's headers -
# else the Python path runs; the tests install both (compiler), so that the
# suite runs the C path (and `pure` the Python one).
BUILD := pyproject.toml hatch_build.py src/healthgate/_speedups.c src/healthgate/_kept.c
$(RUNTIME): $(BUILD) | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	@touch $(RUNTIME)

$(STAMP): $(BUILD) | $(BIN)/python compiler
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(RUNTIME) $(STAMP)

compiler: | $(BIN)/python
	@need=""; \
	$(BIN)/python -c 'import sysconfig, shlex, shutil, sys; sys.exit(not shutil.which(shlex.split(sysconfig.get_config_var("CC") or "cc")[0]))' \
	  || need="gcc"; \
	$(BIN)/python -c 'import sysconfig, pathlib, sys; sys.exit(not pathlib.Path(sysconfig.get_paths()["include"], "Python.h").exists())' \
	  || need="$$need python3-dev"; \
	if [ -n "$$need" ]; then echo "installing Debian's $$need (the C speedups)"; apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need >/dev/null; fi

run: $(RUNTIME)
	$(BIN)/healthgate demo

simulate: $(RUNTIME)
	$(BIN)/healthgate simulate -f examples/two-regions.yaml \
	  --scenario examples/scenario-us-east1-hangs.yaml

lint: $(STAMP)
	$(BIN)/ruff check src tests bench hatch_build.py
	$(BIN)/ruff format --check src tests bench hatch_build.py

typecheck: $(STAMP)
	$(BIN)/mypy

# two workers for most of the suite (it waits on real clocks, not on a core),
# then the cluster, partition and closely timed tests alone (tests/conftest.py)
SERIAL := cluster or partitions or serial
unit: $(STAMP)
	$(BIN)/pytest -q -n 2 --dist loadgroup -m "not ($(SERIAL))" --durations=15
	$(BIN)/pytest -q -m "$(SERIAL)" --durations=15

# the pure engine and the store contract: seconds, for the edit-test loop
# (the slow families have markers: pytest -m "not cluster and not partitions")
fast: $(STAMP)
	$(BIN)/pytest -q tests/unit tests/contract -m "not cluster and not partitions"

# the pure-Python fallback of the C speedups, through the data-plane and probe tests
PURE_TESTS := tests/unit/test_http_scan.py tests/unit/test_fast_protocols.py tests/integration/test_proxies.py \
              tests/integration/test_front_end_limits.py tests/integration/test_front_end_buffers.py \
              tests/integration/test_probes.py tests/integration/test_probe_body.py \
              tests/integration/test_trust_http.py tests/integration/test_counters.py \
              tests/unit/test_kept_lane.py tests/integration/test_kept_lane.py
pure: $(STAMP)
	HEALTHGATE_PURE_PYTHON=1 $(BIN)/pytest -q $(PURE_TESTS)

# Programs the tests start for real, from Debian (never a downloaded binary):
# chromium (the dashboard's browser tests), haproxy (the agent-check integration),
# dig (the DNS integration), etcd (the etcd store and cluster mode), nft and ip
# (the partition tests: regions as network namespaces, links cut with nftables),
# promtool and prometheus (the shipped alerts, and a real Prometheus scraping serve)
# (prometheus without its recommended node exporter: the tests start their own
# Prometheus, and a machine that runs systemd would start both as services)
TEST_PROGRAMS := chromium:chromium haproxy:haproxy dig:bind9-dnsutils etcd:etcd-server \
                 nft:nftables ip:iproute2
BARE_PROGRAMS := promtool:prometheus
programs:
	@missing=""; bare=""; for pair in $(TEST_PROGRAMS); do \
	  cmd=$${pair%%:*}; pkg=$${pair##*:}; \
	  command -v $$cmd >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	for pair in $(BARE_PROGRAMS); do \
	  cmd=$${pair%%:*}; pkg=$${pair##*:}; \
	  command -v $$cmd >/dev/null 2>&1 || bare="$$bare $$pkg"; done; \
	if [ -n "$$missing$$bare" ]; then \
	  echo "installing Debian's$$missing$$bare for the tests"; apt-get update -qq; fi; \
	if [ -n "$$missing" ]; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi; \
	if [ -n "$$bare" ]; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$bare >/dev/null; fi

browser: programs

test: lint typecheck programs unit pure

bench: $(STAMP)
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
