# `make demo` and `make test` build .venv from nothing, then reuse it (the stamp tracks pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIPESCOPE ?= $(VENV)/bin/pipescope
DEMO_OUT ?= demo-out

.PHONY: demo demo-run test lint bench clean gpu-site

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# The exact pin takes the CPU wheel; an open range would pull a multi-GB CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[calibration,sweep,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(MAKE) --no-print-directory demo-run

# The demo command itself; tests/test_outputs.py runs this target with its own PIPESCOPE and DEMO_OUT.
demo-run:
	$(PIPESCOPE) simulate --config pipescope/configs/demo.yaml --gantt $(DEMO_OUT)/gantt.png --trace $(DEMO_OUT)/trace.json.gz

test: $(STAMP)
	$(PY) -m ruff check pipescope simulator topologies calibration executor experiments tests
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PIPESCOPE) bench

# The pure-Python packages validate needs beyond a GPU box's torch, pandas and pyarrow, to carry there
# (experiments/gpu_session.py; docs/validation.md, "A GPU session").
gpu-site: $(STAMP)
	rm -rf .gpu-site
	$(PY) -m pip install --no-deps --target .gpu-site \
		$$($(PY) -c 'from pipescope.experiments.gpu_session import CARRIED; print(*CARRIED)')

clean:
	rm -rf $(VENV) $(DEMO_OUT) .gpu-site
