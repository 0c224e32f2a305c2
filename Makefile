# One-command setup and checks for the MiniMind course. Needs only python3 and the package registries.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
WANDB_STAMP := $(VENV)/.wandb-installed
# A room without internet: `make wheelhouse` fills wheelhouse/ (every wheel the course needs); when that folder holds
# wheels, every install below uses only it (no network). WHEELHOUSE=DIR names another folder.
WHEELHOUSE ?= wheelhouse
PIP_FROM := $(if $(wildcard $(WHEELHOUSE)/*.whl),--no-index --find-links $(abspath $(WHEELHOUSE)))
# `make notebooks` runs the notebooks that time things beside BUSY processes that keep the cores busy (a CI machine
# under load: as many as its 2 cores).
BUSY ?= 2
# pytest-xdist processes for `make unit` (UNIT_WORKERS=2) and `make notebooks` (NB_WORKERS=2); empty: one process.
# tools/time_make_test.sh measures a clean clone's stages both ways.
UNIT_WORKERS ?=
NB_WORKERS ?=
# Every Python these targets start (tests, notebook kernels, the course): an OpenMP thread that waits for its
# partner spins briefly, then sleeps, so 2 cores shared with other processes do not stall every small matmul. The
# same rule as minimind_lib/__init__.py (notebook 00; `python -m benchmarks threads`); yours win if you set either.
ifeq ($(origin OMP_WAIT_POLICY)$(origin GOMP_SPINCOUNT),undefinedundefined)
export OMP_WAIT_POLICY := PASSIVE
export GOMP_SPINCOUNT := 1000
endif

.PHONY: venv lab test unit notebooks course kernel browser-test clean prepare-workshop handout reset course-times wheelhouse \
	tensorboard

venv: $(STAMP)

# Re-install only when the pins or the package metadata change.
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(PIP_FROM),@echo "installing from $(WHEELHOUSE)/ only (no network)")
	$(PY) -m pip install --quiet $(PIP_FROM) --upgrade pip
	$(PY) -m pip install --quiet $(PIP_FROM) -r requirements.txt
	$(PY) -m pip install --quiet $(PIP_FROM) --no-deps -e .
	touch $(STAMP)

# --log wandb's package, for the tests that read its offline runs back (the course itself does not need it).
$(WANDB_STAMP): requirements-wandb.txt $(STAMP)
	$(PY) -m pip install --quiet $(PIP_FROM) -r requirements-wandb.txt
	touch $(WANDB_STAMP)

# Every wheel `make venv` installs, for this machine's platform and Python (or PLATFORM=manylinux_2_28_x86_64
# PYVER=3.11 for another room's), into $(WHEELHOUSE)/: copy the checkout with it to a room without internet.
wheelhouse:
	$(PYTHON) -m pip download --quiet --dest $(WHEELHOUSE) -r requirements.txt -r requirements-wandb.txt pip setuptools wheel \
		$(if $(PLATFORM),--platform $(PLATFORM) --python-version $(PYVER) --only-binary=:all:)
	@echo "$(WHEELHOUSE)/: $$(ls $(WHEELHOUSE) | wc -l) files, $$(du -sh $(WHEELHOUSE) | cut -f1); make lab / make test now install from it alone"

# The kernel's display name names this checkout, so JupyterLab shows which checkout's library a notebook runs (a
# kernel registered from another checkout replaces this one: notebook 00 prints the library it imported, and warns).
# The kernel imports minimind_lib before anything else, which sets OpenMP's wait policy before torch loads.
kernel: venv
	$(PY) -m ipykernel install --user --name minimind --display-name "Python (minimind: $(CURDIR))"
	$(PY) tools/kernel_imports_library.py minimind

lab: kernel
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

# CI and a quick local check: unit tests, then every notebook with nbval in the smoke profile.
test: unit notebooks

unit: venv $(WANDB_STAMP)
	MINIMIND_PROFILE=smoke $(PY) -m pytest tests/ -q --durations=20 $(if $(UNIT_WORKERS),-n $(UNIT_WORKERS))

# The chapters, once each. Their worked solutions run in the unit stage, in the handout as learners get them
# (tests/test_workshop_kit.py). The notebooks that time things (04-06) run beside BUSY processes that keep the cores
# busy (tests/notebooks_stage.py): a cell that asserted a time would fail here as on a loaded CI machine.
notebooks: venv
	MINIMIND_PROFILE=smoke $(PY) -m pytest --nbval-lax --nbval-current-env --nbval-cell-timeout=900 -p no:cacheprovider \
		-p tests.notebooks_stage --busy $(BUSY) --busy-notebooks '04_*,05_*,06_*' notebooks/[0-9][0-9]_*.ipynb -q \
		$(if $(NB_WORKERS),-n $(NB_WORKERS))

# Execute every notebook in order (cpu or gpu profile, chosen as usual) into build/, with its figures; each run
# also writes its per-cell timings to docs/timings/<profile>.json, which docs/teaching.md's table is made from.
course: venv
	$(PY) tools/run_course.py --out build

# The course in JupyterLab in headless Chromium (smoke profile): Run All on 06 and 08, widgets, figures, chat box.
# Chromium and a CJK font come from the system's packages (installed if missing, as root); screenshots in build/browser/.
browser-test: kernel
	command -v chromium >/dev/null 2>&1 && fc-list :lang=zh | grep -q . || \
		{ apt-get update -qq && apt-get install -y -qq chromium fonts-wqy-zenhei; }
	$(PY) -m pip install --quiet -r requirements-browser.txt
	$(PY) tools/browser_test.py

# Rewrite the minutes-per-notebook tables in docs/teaching.md from docs/timings/*.json and the notebooks' text, then
# every number the docs quote from those tables or from the committed notebook outputs (never typed by hand): rerun
# it after the notebooks are executed again.
course-times: venv
	$(PY) tools/course_times.py --write docs/teaching.md
	$(PY) tools/doc_numbers.py docs/teaching.md docs/answers.md README.md

# Before class: train the runs later notebooks reuse (07's pretraining, which 08 starts from), workshop profile.
prepare-workshop: venv
	MINIMIND_PROFILE=workshop $(PY) tools/prepare_workshop.py --profile workshop

# The course to hand out, output-stripped: build/handout/notebooks/ (the chapters), lab/ (the lab edition: every
# solution region a stub to write), solutions/ (apart) and data/. Replaces only files it wrote and nobody changed
# since; FORCE=1 replaces changed ones too, FORCE="lab/03_model.ipynb ..." just those.
handout: venv
	$(PY) tools/handout.py --out build/handout $(if $(FORCE),--force $(filter-out 1,$(FORCE)))

# Back to what a new learner gets: no runs, caches or builds, the committed notebooks. Asks first, unless YES=1.
reset:
	@if [ "$(YES)" != "1" ]; then \
	  printf 'This deletes runs/, data/cache/ and build/ and discards every change to notebooks/. Continue? [y/N] '; \
	  read answer; case "$$answer" in y|Y|yes|YES) ;; *) echo "reset cancelled: nothing changed"; exit 1;; esac; \
	fi
	rm -rf runs data/cache build
	git checkout -- notebooks/
	@echo "reset: runs/, data/cache/ and build/ removed; notebooks/ restored to the committed version"

# TensorBoard on RUN: a run directory trained with --log tensorboard, or a folder of many (a room's runs in one
# view, each named by its path); http://localhost:6006 (PORT=... for another port, HOST=0.0.0.0 to serve a room).
tensorboard: venv
	@test -n "$(RUN)" || { echo "usage: make tensorboard RUN=runs/cpu/pretrain (a run directory or a folder of runs)" >&2; exit 2; }
	@test -d "$(RUN)" || { echo "error: RUN=$(RUN) is not a directory" >&2; exit 2; }
	@find "$(RUN)" -name 'events.out.tfevents.*' | grep -q . || { echo "error: RUN=$(RUN) holds no TensorBoard event files: train with --log tensorboard (notebook 07 writes them too)" >&2; exit 2; }
	$(VENV)/bin/tensorboard --logdir "$(RUN)" --port $(or $(PORT),6006) $(if $(HOST),--host $(HOST))

clean:
	rm -rf build .pytest_cache
