# Two entry points (see README): `make demo` runs the main job, `make test` runs the suite.
# Both build .venv from scratch on a fresh machine. torch is pinned and installed first:
# the pin takes the CPU build that lies on this kind of machine's disk; a looser
# requirement would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo compare test install clean bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,ray]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/elasticflow demo

compare: $(STAMP)
	$(BIN)/elasticflow compare

# Chromium (browser test) and PostgreSQL (store test) come from the distribution's
# packages when missing; the scripts never fail, the tests skip with a reason.
test: $(STAMP)
	@sh infra/ensure-chromium.sh
	@sh infra/ensure-postgres.sh
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q

bench: $(STAMP)
	$(BIN)/python bench/simulate.py
	$(BIN)/python bench/admission.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
