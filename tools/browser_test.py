"""The course in a real browser: `python tools/browser_test.py` (what `make browser-test` runs).

Starts JupyterLab on 127.0.0.1 with a random token in the smoke profile, on copies of the notebooks (so nothing
here writes into notebooks/), and drives it with Playwright in the system's Chromium (no browser download).
It opens 06 and 08, runs all cells from the Run menu, waits for the kernel to go idle, and checks what a learner
sees: the `minimind` kernel started, no cell raised, tqdm bars are widgets at 100%, figures are images, the chat
box renders, and a typed message gets a streamed, non-empty answer in which no character changes once shown
(a character split across tokens appears whole, not as U+FFFD first). Screenshots go to
build/browser/. Every process started here is stopped at the end, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# JupyterLab settings for the test's own settings folder: no autosave, every cell in the DOM, no news pop-ups.
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
}
MESSAGES = ["Hello, who are you?", "Tell me a joke about computers."]


class CheckFailed(AssertionError):
    """A check of what the learner sees failed."""


def check(condition: bool, message: str) -> None:
    """Raise CheckFailed(message) unless condition holds; print the passed check otherwise."""
    if not condition:
        raise CheckFailed(message)
    print(f"  ok: {message}", flush=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server started for the test, with its REST API; `stop()` ends it and its kernels."""

    def __init__(self, work: Path, out: Path, env: dict) -> None:
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        settings = out / "lab-settings"
        for name, value in LAB_SETTINGS.items():
            (settings / name).parent.mkdir(parents=True, exist_ok=True)
            (settings / name).write_text(json.dumps(value))
        args = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={work}", f"--LabApp.user_settings_dir={settings}",
                f"--LabApp.workspaces_dir={out / 'lab-workspaces'}"]
        if os.geteuid() == 0:
            args.append("--allow-root")
        self.log = (out / "jupyterlab.log").open("w")
        self.proc = subprocess.Popen(args, cwd=work, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.kernel_ids: set[str] = set()

    def api(self, path: str, method: str = "GET") -> object:
        """JSON from the server's REST API (authenticated with the token)."""
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def wait_ready(self, timeout: float = 180) -> None:
        """Wait until the server answers, or fail with the end of its log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CheckFailed(f"JupyterLab exited with code {self.proc.returncode}; see {self.log.name}")
            try:
                self.api("status")
                return
            except OSError:
                time.sleep(0.5)
        raise CheckFailed(f"JupyterLab did not answer within {timeout:.0f} s; see {self.log.name}")

    def kernel_state(self, kernel_id: str) -> str:
        """The kernel's execution_state ('busy', 'idle', 'starting', ...)."""
        return self.api(f"kernels/{kernel_id}")["execution_state"]

    def stop(self) -> None:
        """Shut down the kernels and the server; kill what is left of them (by their own ids, nothing else)."""
        if self.proc.poll() is None:
            try:
                self.kernel_ids |= {k["id"] for k in self.api("kernels")}
                self.api("shutdown", method="POST")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in kernel_pids(self.kernel_ids):  # a kernel runs in its own session: not in the server's group
            os.kill(pid, signal.SIGKILL)
        self.log.close()


def kernel_pids(kernel_ids: set[str]) -> list[int]:
    """Process ids whose command line names the connection file of one of these kernels."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if any(f"kernel-{kid}.json" in cmdline for kid in kernel_ids):
            pids.append(int(proc.name))
    return pids


def run_all(page, lab: Lab, name: str, out: Path, timeout: float) -> tuple[str, str, float]:
    """Open notebook `name`, check its kernel, Run All Cells from the menu, wait for idle; return session, kernel and
    the seconds a learner waited (from the click on Run All Cells until the kernel is idle with no cell queued)."""
    print(f"{name}: opening", flush=True)
    page.goto(f"{lab.url}/lab/tree/{name}?reset")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)
    deadline, sessions = time.monotonic() + 180, []
    while not sessions and time.monotonic() < deadline:  # the session appears once the kernel is started
        sessions = [s for s in lab.api("sessions") if s["path"].endswith(name) and s.get("kernel")]
        page.wait_for_timeout(500)
    found = "" if sessions else f" (sessions: {lab.api('sessions')})"
    check(len(sessions) == 1, f"{name}: one kernel session was started{found}")
    kernel = sessions[0]["kernel"]
    lab.kernel_ids.add(kernel["id"])
    check(kernel["name"] == "minimind", f"{name}: the kernel is 'minimind' (got {kernel['name']!r})")
    while lab.kernel_state(kernel["id"]) != "idle" and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    kernel_label = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Toolbar-kernelName").first.inner_text()
    check(kernel_label == f"Python (minimind: {REPO})", f"{name}: the toolbar names the kernel {kernel_label!r}, "
          f"registered by `make kernel` in this checkout")
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    start = time.monotonic()
    page.wait_for_timeout(2000)
    idle_since = None
    while time.monotonic() - start < timeout:  # idle for 3 s with no cell queued ([*]) = the run is over
        queued = page.locator(".jp-InputArea-prompt", has_text="*").count()
        idle = lab.kernel_state(kernel["id"]) == "idle" and queued == 0
        idle_since = (idle_since or time.monotonic()) if idle else None
        if idle_since and time.monotonic() - idle_since > 3:
            break
        page.wait_for_timeout(1000)
    else:
        page.screenshot(path=str(out / f"{Path(name).stem}_timeout.png"))
        raise CheckFailed(f"{name}: Run All did not finish within {timeout:.0f} s")
    waited = time.monotonic() - start - 3  # the last 3 s only confirmed the kernel stayed idle
    print(f"{name}: Run All finished in {waited:.0f} s", flush=True)
    return sessions[0]["id"], kernel["id"], waited


def check_outputs(page, work: Path, name: str, out: Path) -> nbformat.NotebookNode:
    """Save the (copied) notebook, then check: every code cell ran, none raised, every figure shows as an image."""
    page.keyboard.press("Control+s")
    page.wait_for_function("() => !document.querySelector('.jp-mod-dirty')", timeout=30_000)
    nb = nbformat.read(work / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    check(not errors, f"{name}: no error outputs {errors[:3] if errors else ''}")
    check(all(c.execution_count for c in code), f"{name}: all {len(code)} code cells ran")
    check(page.get_by_text("Error displaying widget").count() == 0, f"{name}: no 'Error displaying widget'")
    pngs = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    shown = page.evaluate("""() => [...document.querySelectorAll('.jp-Notebook .jp-RenderedImage img')]
                             .filter(img => img.complete && img.naturalWidth > 0).length""")
    check(pngs > 0 and shown == pngs, f"{name}: {pngs} figures, {shown} shown as loaded images")
    page.screenshot(path=str(out / f"{Path(name).stem}_run_all.png"), full_page=True)
    return nb


def check_progress_bars(page, name: str) -> None:
    """tqdm bars are rendered as ipywidgets progress bars, and each is at 100%."""
    bars = page.evaluate("""() => [...document.querySelectorAll('.jp-Notebook .widget-hprogress')].map(p => {
        const bar = p.querySelector('.progress-bar');
        return {width: bar.style.width, done: bar.classList.contains('progress-bar-success'),
                text: p.parentElement.innerText};})""")
    check(len(bars) > 0, f"{name}: {len(bars)} tqdm bar(s) rendered as widgets")
    check(all(b["width"] == "100%" and b["done"] and "100%" in b["text"] for b in bars),
          f"{name}: every bar reached 100% {[b['text'].replace(chr(10), ' ') for b in bars]}")


def ask(page, lab: Lab, kernel_id: str, message: str, timeout: float) -> tuple[list[str], str]:
    """Type `message` into the chat box and press Enter; return the answer's successive texts and the last one."""
    field = page.locator(".jp-Notebook .widget-text input[placeholder^='Ask something']")
    answer = page.locator(".jp-Notebook .widget-html-content").filter(has_text="you:").first
    page.evaluate("""() => { window.__chat = []; window.__chatObserver?.disconnect();
        const box = [...document.querySelectorAll('.jp-Notebook .widget-html-content')]
                    .find(e => e.closest('.widget-vbox') && e.closest('.widget-vbox').querySelector('.widget-text'));
        window.__chatObserver = new MutationObserver(() => window.__chat.push(box.innerText));
        window.__chatObserver.observe(box, {childList: true, subtree: true, characterData: true}); }""")
    field.fill(message)
    field.press("Enter")
    page.wait_for_function(f"() => window.__chat.some(t => t.includes({json.dumps(message)}))", timeout=60_000)
    start = time.monotonic()
    while lab.kernel_state(kernel_id) != "idle" and time.monotonic() - start < timeout:
        page.wait_for_timeout(200)
    page.wait_for_timeout(1000)
    states = page.evaluate("() => window.__chat")
    return states, answer.inner_text()


def check_chat(page, lab: Lab, kernel_id: str, name: str, out: Path, timeout: float) -> None:
    """The chat box renders; typed messages get streamed, non-empty answers, answered per message, each streamed text a
    prefix of the answer (a split character is held until whole, never shown as U+FFFD and then replaced)."""
    field = page.locator(".jp-Notebook .widget-text input[placeholder^='Ask something']")
    check(field.count() == 1, f"{name}: the chat box's text field renders")
    check(page.locator(".jp-Notebook .widget-button", has_text="Send").count() == 1, f"{name}: the Send button renders")
    check(page.locator(".jp-Notebook .widget-slider").count() >= 2, f"{name}: the temperature and top-p sliders render")
    field.scroll_into_view_if_needed()
    answers = []
    for i, message in enumerate(MESSAGES):
        states, final = ask(page, lab, kernel_id, message, timeout)
        page.screenshot(path=str(out / f"{Path(name).stem}_chat_{i + 1}.png"))
        reply = final.split("model:", 1)[-1].strip()
        print(f"  {message!r} -> {reply[:120]!r} ({len(states)} updates)", flush=True)
        partial = {s.split("model:", 1)[-1].strip() for s in states if message in s}
        check(final.startswith(f"you: {message}"), f"chat: the answer is to the typed message {message!r}")
        check(len(reply) > 0, "chat: the answer is not empty")
        check(len(partial - {"", reply}) >= 1, f"chat: the answer streamed in ({len(partial)} distinct texts)")
        check(all(reply.startswith(p) for p in partial), "chat: every streamed text is a prefix of the answer "
              "(a character split across tokens appears whole)")
        answers.append(reply)
    check(answers[0] != answers[1], "chat: two different messages got different answers")


def main(argv: list[str] | None = None) -> int:
    """Run the browser test; exit 0 when every check passed, 1 otherwise."""
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "build" / "browser")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for one notebook's Run All")
    parser.add_argument("--notebooks", nargs="+", default=["06_dynamic_batching.ipynb", "08_sft.ipynb"],
                        help="notebook names, or 'all' for every numbered notebook in order")
    parser.add_argument("--profile", default="smoke", help="MINIMIND_PROFILE of the kernels (CI: smoke)")
    parser.add_argument("--record", action="store_true",
                        help="write each Run All's seconds to docs/timings/browser-PROFILE.json (teaching guide)")
    args = parser.parse_args(argv)
    if args.notebooks == ["all"]:
        args.notebooks = sorted(p.name for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if not Path(args.chromium).is_file():
        print(f"error: no Chromium at {args.chromium}; install Debian's package: apt-get install chromium",
              file=sys.stderr)
        return 2
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    work = out / "notebooks"  # copies: Run All and the save below never touch notebooks/
    shutil.copytree(REPO / "notebooks", work, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    # A fresh runs/ folder, as on a fresh clone: 08 then pretrains the model it fine-tunes itself.
    env = dict(os.environ, MINIMIND_PROFILE=args.profile, MINIMIND_RUNS_DIR=str(out / "runs"))
    waits: dict[str, float] = {}
    lab = Lab(work, out, env)
    try:
        lab.wait_ready()
        spec = lab.api("kernelspecs")["kernelspecs"].get("minimind")
        check(spec is not None, "the 'minimind' kernel is registered (make kernel)")
        check(os.path.abspath(spec["spec"]["argv"][0]) == os.path.abspath(sys.executable),
              f"the 'minimind' kernel runs this checkout's Python ({spec['spec']['argv'][0]})")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, headless=True, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                page.set_default_timeout(60_000)
                page.goto(f"{lab.url}/lab?reset&token={lab.token}")
                page.locator(".jp-DirListing-item").first.wait_for(timeout=120_000)
                listed = set(page.locator(".jp-DirListing-itemText").all_inner_texts())
                course = {p.name for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")}
                check(course <= listed, f"the file browser lists the {len(course)} course notebooks")
                page.screenshot(path=str(out / "notebook_list.png"))
                for name in args.notebooks:
                    session_id, kernel_id, waits[name] = run_all(page, lab, name, out, args.timeout)
                    check_outputs(page, work, name, out)
                    if name.startswith("08"):
                        check_progress_bars(page, name)
                        check_chat(page, lab, kernel_id, name, out, args.timeout)
                    lab.api(f"sessions/{session_id}", method="DELETE")  # done with it: its kernel shuts down
            except Exception:
                page.screenshot(path=str(out / "failure.png"))  # what the browser showed when it failed
                raise
            finally:
                browser.close()
    except CheckFailed as failure:
        print(f"FAILED: {failure}", file=sys.stderr)
        return 1
    finally:
        lab.stop()
    print(f"browser test passed; screenshots in {out}")
    if args.record:
        print(f"wrote {record_waits(waits, args.profile)}")
    return 0


def record_waits(waits: dict[str, float], profile: str) -> Path:
    """Store the Run All seconds as docs/timings/browser-PROFILE.json, in the form tools/course_times.py reads."""
    from course_times import update_timings
    from minimind_lib.device import describe
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    records = [{"notebook": name, "seconds": round(s, 1), "n_cells_timed": 0, "executed_utc": stamp, "error": None,
                "cells": [], "load_average": round(os.getloadavg()[0], 2)} for name, s in waits.items()]
    device = re.sub(r", profile=\w+", "", describe())  # e.g. "cpu (AMD EPYC), torch 2.13.0"
    return update_timings(f"browser-{profile}", device, records)


if __name__ == "__main__":
    sys.exit(main())
