"""The notebooks stage of `make test`, a pytest plugin (`-p tests.notebooks_stage`; the Makefile's notebooks target).

Under load: `--busy N --busy-notebooks 04_*,05_*` runs N processes that keep the cores busy from the first cell of
each matching notebook to its last, so the ordinary nbval pass of the notebooks that time things is also their check
under load: a cell that asserted a time, a speed or a ratio of times would fail here as it would on a loaded CI
machine (the course's rule is that none does). The summary says, for each such notebook, how long it ran under load
and how many CPU seconds the busy processes took meanwhile.

In parallel: under pytest-xdist (`-n 2`, `make notebooks NB_WORKERS=2`) every cell of a notebook goes to one worker,
in order, and a chapter that starts from the runs 07 writes (TOGETHER: 08, 10) goes with 07, after it. A new chapter
needs nothing here unless it reads an earlier chapter's run: then one entry in TOGETHER."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import time

import pytest

# What a busy process runs: additions, with a look at its parent between batches, so that it ends within a
# fraction of a second of the pytest process that started it, even one killed outright.
SPIN = ("# a busy process of the notebooks stage (tests/notebooks_stage.py)\nimport os\nparent = os.getppid()\n"
        "while os.getppid() == parent:\n    for _ in range(1_000_000):\n        pass\n")
# a chapter -> the chapter whose worker must run it, after it (08 fine-tunes 07's run; 10 starts from 07's and 08's)
TOGETHER = {"08_sft": "07_pretrain", "10_lora_dpo": "07_pretrain"}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("notebooks stage")
    group.addoption("--busy", type=int, default=0, metavar="N",
                    help="processes that keep the cores busy while a notebook of --busy-notebooks runs")
    group.addoption("--busy-notebooks", default="", metavar="PATTERNS",
                    help="comma-separated file-name patterns of the notebooks to run under load (04_*,05_*)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("busy") < 0:
        raise pytest.UsageError(f"--busy={config.getoption('busy')}: must be 0 or more processes")
    patterns = [p for p in config.getoption("busy_notebooks").split(",") if p]
    if config.getoption("busy") and not patterns:
        raise pytest.UsageError("--busy needs --busy-notebooks: which notebooks to run under load")
    config.pluginmanager.register(UnderLoad(config.getoption("busy"), patterns), "notebooks_stage_under_load")


def scope_of(nodeid: str) -> str:
    """The unit of work of a cell under pytest-xdist: its notebook, or the notebook it must follow."""
    path = nodeid.split("::")[0]
    stem = path.rsplit("/", 1)[-1].removesuffix(".ipynb")
    return path.replace(stem, TOGETHER[stem]) if stem in TOGETHER else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under pytest-xdist: each unit of work (scope_of) to one worker, its cells in order."""
    from xdist.scheduler import LoadScopeScheduling

    class ByNotebook(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ByNotebook(config, log)


class UnderLoad:
    """Starts the busy processes before a matching notebook's first cell and stops them after its last."""

    def __init__(self, n: int, patterns: list[str]) -> None:
        self.n, self.patterns = n, patterns
        self.procs: list[subprocess.Popen] = []
        self.started = 0.0
        self.lines: list[str] = []

    def start(self) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(self.n)]
        self.started = time.monotonic()

    def stop(self, name: str) -> None:
        seconds, cpu = time.monotonic() - self.started, 0.0
        for proc in self.procs:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)  # the rusage of this child alone
            proc.returncode = os.waitstatus_to_exitcode(status)
            cpu += usage.ru_utime + usage.ru_stime
        self.lines.append(f"{name}: ran {seconds:.1f} s beside {len(self.procs)} busy processes, which took "
                          f"{cpu:.1f} CPU s meanwhile")
        self.procs = []

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        if self.n and not self.procs and any(fnmatch.fnmatch(item.path.name, p) for p in self.patterns):
            self.start()  # before the first cell's setup, which starts the notebook's kernel
        try:
            return (yield)
        finally:
            if self.procs and (nextitem is None or nextitem.path != item.path):
                self.stop(item.path.name)  # after the last cell's teardown, which stops the kernel

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.procs:  # an interrupted run
            self.stop("(interrupted)")
        if hasattr(session.config, "workeroutput"):  # an xdist worker: the lines go to the controller
            session.config.workeroutput["under_load"] = self.lines

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        self.lines += getattr(node, "workeroutput", {}).get("under_load", [])

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for line in sorted(self.lines):
            terminalreporter.write_line(f"under load: {line}")
