"""Try the command line as an adversarial user would, and write what each attempt gets to docs/reliability.md.

    python tools/reliability_cases.py [--out docs/reliability.md]

Every case runs `python -m minimind_lib ...` (or a few lines of library code) in a fresh process in the smoke profile
on tiny sizes, in a temporary folder: bad data, bad checkpoints, kills and resumes, two runs into one --out, bad
flags, API misuse. The table records the exit code and the first error line each one printed (or, for a run that
should succeed, what it checked). It takes a few minutes; it is not part of `make test`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
TINY = ["--profile", "smoke", "--seq-len", "32", "--max-tokens", "128", "--accum", "1", "--max-samples", "48",
        "--val-batches", "1", "--no-progress"]
ENV = {**os.environ, "MINIMIND_PROFILE": "smoke", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
       "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


class Cases:
    """Runs the cases in one temporary folder T and keeps the table's rows."""

    def __init__(self, tmp: Path) -> None:
        self.t, self.rows = tmp, []
        self.cache = ["--cache", str(tmp / "cache")]

    def local(self, text: str) -> str:
        """Paths as the table shows them: T for the temporary folder, relative to the checkout otherwise (a byte
        that is not UTF-8, as \\xff)."""
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        return text.replace(str(self.t), "T").replace(f"{ROOT}/", "").replace(str(ROOT), ".")

    def show(self, args: list) -> str:
        text = self.local(" ".join(str(a) or "''" for a in args)).replace(" ".join(TINY), "TINY")
        return text.replace(" --cache T/cache", "")

    def start(self, args: list) -> subprocess.Popen:
        argv = [sys.executable, "-m", "minimind_lib", *map(str, args)]
        return subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, case: str, args: list, expect: int | None = 2, check=None, python: str | None = None,
            tiny: bool = True, file_limit: int | None = None, argv: list | None = None, wrap: list = ()) -> dict:
        """Run one command (python: library code instead of the CLI; argv: another program, as `python ...` for this
        Python) and record exit code and first error line; file_limit: the largest file it may write, in bytes
        (ulimit -f); wrap: a command prefix (setpriv)."""
        if python is not None:
            argv, shown = [sys.executable, "-c", python], self.local(f"python -c '{python}'")
        elif argv is not None:
            argv = [str(a) for a in argv]
            shown = self.local(" ".join(a or "''" for a in argv).replace(sys.executable, "python"))
        else:
            train = args[0] in ("pretrain", "sft")
            args = [*args, *(TINY if tiny and train else []), *(self.cache if train and "--cache" not in args else [])]
            argv, shown = [sys.executable, "-m", "minimind_lib", *map(str, args)], self.show(["minimind", *args])
        limit = None if file_limit is None else lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit,) * 2)
        if file_limit is not None:
            shown = f"ulimit -f {file_limit // 1024}; {shown}"
        argv, shown = [*wrap, *argv], " ".join([*wrap, shown])
        p = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600, preexec_fn=limit)
        return self.record(case, shown, p.returncode, p.stdout, p.stderr, expect, check)

    def record(self, case: str, shown: str, code: int, out: str, err: str, expect: int | None, check) -> dict:
        self.last_out = out  # what a check may read (a --json result)
        lines = [line for line in err.splitlines() if line.strip()]
        last = lines[-1] if lines else ""  # a library call's exception is the traceback's last line
        first = next((line for line in lines if line.startswith("error:") or ": error:" in line), last)
        note = "" if check is None else check(err) if check.__code__.co_argcount else check()  # check(err): reads it
        library = shown.startswith("python -c")  # a library call raises: its traceback is the expected output
        tracebacks = 0 if library else err.count("Traceback")
        warning = next((line.split("Warning: ", 1)[1] for line in lines if "Warning: " in line), "")
        result = "ok" + (f", warns: {warning}" if warning else "") + (f", prints: {out.strip()}" if out.strip() else "")
        result = result if library else "ok"
        first = f"(killed by signal {-code}: no output)" if code < 0 else first or "(nothing on stderr)"
        what = (first if code else result) + (f"; {note}" if note else "") + ("; TRACEBACK" if tracebacks else "")
        ok = (expect is None or code == expect) and not tracebacks and note is not False
        self.rows.append((case, shown.replace("|", "\\|"), code, self.local(what).replace("|", "\\|"),
                          "yes" if ok else "**NO**"))
        print(f"[{'ok' if ok else 'UNEXPECTED'}] {case}: exit {code}: {what[:150]}", flush=True)
        return {"code": code, "out": out, "err": err}

    def data(self, name: str, lines: list[str]) -> Path:
        path = self.t / name
        path.write_text("".join(lines), encoding="utf-8")
        return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): digest(p) for p in sorted(d.rglob("*")) if p.is_file()}


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 300) -> bool:
    end = time.time() + seconds
    while time.time() < end and proc.poll() is None:
        if path.exists() and path.stat().st_size > 0:
            return True
        time.sleep(0.05)
    return False


def data_cases(c: Cases, pre_lines: list[str]) -> None:
    t = c.t
    c.run("data file missing", ["pretrain", "--out", t / "r1", "--data", t / "nope.jsonl"])
    bad = c.data("bad.jsonl", pre_lines[:30] + ["{not json\n"] + pre_lines[30:60])
    c.run("a line that is not JSON", ["pretrain", "--out", t / "r2", "--data", bad, "--steps", 1])
    c.run("the same, --on-error skip", ["pretrain", "--out", t / "r3", "--data", bad, "--steps", 1,
                                         "--on-error", "skip"], expect=0,
          check=lambda: f"n_skipped={json.loads((t / 'r3/config.json').read_text())['data_stats']['n_skipped']}")
    c.run("empty data file", ["pretrain", "--out", t / "r4", "--data", c.data("empty.jsonl", [])])
    c.run("pretrain file given to sft", ["sft", "--out", t / "r5", "--init", t / "pre", "--data",
                                         DATA / "pretrain.jsonl", "--steps", 1])
    long_system = json.dumps({"conversations": [{"role": "system", "content": "word " * 100},
                                                {"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}]}) + "\n"
    c.run("SFT data with no assistant token within --seq-len", ["sft", "--out", t / "r6", "--init", t / "pre", "--data",
                                                                c.data("cut.jsonl", [long_system]), "--steps", 1],
          check=lambda: f"--out written: {(t / 'r6').exists()}")


def flag_cases(c: Cases) -> None:
    t = c.t
    for flag, value in [("--steps", 0), ("--accum", 0), ("--max-tokens", 0), ("--lr", 0), ("--lr", "nan"),
                        ("--seq-len", 0), ("--max-samples", -1), ("--stop-after", 0), ("--eval-every", -1)]:
        c.run(f"{flag} {value}", ["pretrain", "--out", t / "f", flag, value])
    c.run("--seq-len above the model's positions", ["pretrain", "--out", t / "f", *TINY[:2], "--seq-len", 4096,
                                                    "--max-tokens", 4096, *TINY[6:]], tiny=False)
    if not torch.cuda.is_available():
        c.run("--device cuda on a machine without CUDA", ["pretrain", "--out", t / "f", "--device", "cuda"])
    (t / "afile").write_text("a file")
    c.run("--out is a regular file", ["pretrain", "--out", t / "afile", "--steps", 1])
    c.run("--out '' (empty)", ["pretrain", "--out", "", "--steps", 1],
          check=lambda: f"nothing written in the current directory: {not (ROOT / 'config.json').exists()}")
    (t / "dangling").symlink_to(t / "gone")
    c.run("--out is a symbolic link to nothing", ["pretrain", "--out", t / "dangling", "--steps", 1])
    c.run("--device gpu0", ["pretrain", "--out", t / "f", "--device", "gpu0"])
    c.run("--cache is a file", ["pretrain", "--out", t / "f", "--steps", 1, "--cache", t / "afile"],
          check=lambda: f"--out written: {(t / 'f').exists()}")
    c.run("chat --temperature nan", ["chat", "--ckpt", t / "pre", "--prompt", "hi", "--temperature", "nan"])
    c.run("chat --max-new-tokens 0", ["chat", "--ckpt", t / "pre", "--prompt", "hi", "--max-new-tokens", 0])


def out_dir_cases(c: Cases) -> None:
    t = c.t
    shutil.copytree(t / "pre", t / "copy")
    before = snapshot(t / "copy")
    c.run("--out holds a run, no --overwrite", ["pretrain", "--out", t / "copy", "--steps", 2],
          check=lambda: f"run unchanged: {snapshot(t / 'copy') == before}")
    (t / "mine/tokenizer").mkdir(parents=True)
    (t / "mine/tokenizer/notes.txt").write_text("the user's")
    c.run("--out/tokenizer/ holds a user's file", ["pretrain", "--out", t / "mine", "--steps", 1],
          check=lambda: f"user's file kept: {(t / 'mine/tokenizer/notes.txt').exists()}")
    users = {".lock": "the user's lock", ".draft.tmp.txt": "the user's draft"}
    for name, text in users.items():
        (t / "mine" / name).write_text(text)
    kept = lambda d: all((d / n).is_file() and (d / n).read_text() == text for n, text in users.items())  # noqa: E731
    c.run("--out holds the user's .lock and .draft.tmp.txt (refused)", ["pretrain", "--out", t / "mine", "--steps", 1],
          check=lambda: f"user's files kept: {kept(t / 'mine')}")
    shutil.copytree(t / "pre", t / "over")
    for name, text in users.items():
        (t / "over" / name).write_text(text)
    c.run("--overwrite a run whose folder holds the user's .lock and .draft.tmp.txt",
          ["pretrain", "--out", t / "over", "--steps", 1, "--overwrite"], expect=0,
          check=lambda: f"user's files kept: {kept(t / 'over')}")
    c.run("--resume on a finished run", ["pretrain", "--out", t / "copy", "--steps", 2, "--resume"],
          check=lambda: f"run unchanged: {snapshot(t / 'copy') == before}")
    c.run("--resume with another --max-tokens", ["pretrain", "--out", t / "copy", "--steps", 2, "--resume",
                                                 *TINY[:4], "--max-tokens", 256, *TINY[6:]], tiny=False)
    c.run("--resume of a folder with no run", ["pretrain", "--out", t / "nothing", "--resume"])
    first = c.start(["pretrain", "--out", t / "two", "--steps", 300, "--eval-every", 100, *TINY, *c.cache])
    wait_for(t / "two/.minimind-lock", first)
    c.run("two runs into one --out (the second)", ["pretrain", "--out", t / "two", "--steps", 300])
    out, err = first.communicate(timeout=600)
    shown = c.show(["minimind", "pretrain", "--out", t / "two", "--steps", 300, "--eval-every", 100, *TINY])
    c.record("two runs into one --out (the first)", shown, first.returncode, out, err, 0,
             lambda: f"its run complete: {json.loads((t / 'two/summary.json').read_text())['steps']} steps")


def checkpoint_cases(c: Cases) -> None:
    t = c.t
    for name, write in [("random bytes", lambda p: p.write_bytes(os.urandom(4096))),
                        ("a pickle payload", lambda p: p.write_bytes(pickle.dumps(Payload(t / "PWNED")))),
                        ("NaN weights", lambda p: poison(p, math.nan)), ("int64 weights", lambda p: poison(p, None)),
                        ("truncated", lambda p: p.write_bytes(p.read_bytes()[:5000]))]:
        shutil.copytree(t / "pre", t / name.replace(" ", "_"))
        write(t / name.replace(" ", "_") / "model.pth")
        c.run(f"model.pth: {name} (chat)", ["chat", "--ckpt", t / name.replace(" ", "_"), "--prompt", "hi"],
              check=(lambda: f"payload ran: {(t / 'PWNED').exists()}") if "pickle" in name else None)
    c.run("model.pth: NaN weights (sft --init)", ["sft", "--out", t / "s1", "--init", t / "NaN_weights", "--steps", 1],
          check=lambda: f"--out written: {(t / 's1').exists()}")
    shutil.copytree(t / "pre", t / "badstate")
    (t / "badstate/last.pt").write_bytes(b"\0" * 100)
    c.run("last.pt zeroed, --resume", ["pretrain", "--out", t / "badstate", "--steps", 4, "--resume"])
    c.run("chat --ckpt a folder that is not a run", ["chat", "--ckpt", t / "cache", "--prompt", "hi"])


class Payload:
    """Unpickling this would create a file: the check that a checkpoint's pickle is never executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def poison(path: Path, value: float | None) -> None:
    state = torch.load(path, weights_only=True)
    key = "model.layers.0.mlp.up_proj.weight"
    state[key] = state[key].long() if value is None else state[key].clone().fill_(value)
    torch.save(state, path)


def kill_cases(c: Cases, pre_lines: list[str]) -> None:
    t = c.t
    run = ["pretrain", "--steps", 12, "--eval-every", 2, *TINY, *c.cache]
    straight = c.run("uninterrupted run (the reference)", ["pretrain", "--out", t / "straight", "--steps", 12,
                                                           "--eval-every", 2], expect=0)
    for sig in (signal.SIGKILL, signal.SIGINT, signal.SIGTERM):
        out = t / f"killed_{sig.name}"
        proc = c.start(["pretrain", "--out", out] + run[1:])
        wait_for(out / "last.pt", proc)
        proc.send_signal(sig)
        o, e = proc.communicate(timeout=600)
        c.record(f"{sig.name} during training", c.show(["minimind", "pretrain", "--out", out] + run[1:]),
                 proc.returncode, o, e, None if sig == signal.SIGKILL else 2,
                 lambda: f"last.pt at step {torch.load(out / 'last.pt', weights_only=True)['step']}")
        c.run(f"--resume after {sig.name}", ["pretrain", "--out", out, "--steps", 12, "--eval-every", 2, "--resume"],
              expect=0, check=lambda: (f"model.pth bit-identical to the uninterrupted run: "
                                       f"{digest(out / 'model.pth') == digest(t / 'straight/model.pth')}; metrics.csv "
                                       f"{same_steps(out, t / 'straight')}"))
    data = c.data("edited.jsonl", pre_lines[:200])
    common = ["--data", data, "--steps", 4]
    c.run("a run stopped after 2 of 4 steps", ["pretrain", "--out", t / "ed", *common, "--stop-after", 2], expect=0)
    data.write_text("".join(pre_lines[100:200]), encoding="utf-8")
    c.run("--resume after 100 lines were deleted from the data", ["pretrain", "--out", t / "ed", *common, "--resume"])
    shutil.copy(DATA / "pretrain.jsonl", t / "mid.jsonl")  # 7 MB
    common = ["--data", t / "mid.jsonl", "--steps", 4]
    c.run("a run stopped after 2 of 4 steps (7 MB data)", ["pretrain", "--out", t / "mid", *common, "--stop-after", 2],
          expect=0)
    content, stat = (t / "mid.jsonl").read_bytes(), (t / "mid.jsonl").stat()
    middle = content.index(b" the ", len(content) // 2)
    (t / "mid.jsonl").write_bytes(content[:middle] + b" THE " + content[middle + 5:])
    os.utime(t / "mid.jsonl", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    c.run("--resume after 'the' became 'THE' mid-file (same size, same mtime)",
          ["pretrain", "--out", t / "mid", *common, "--resume"])
    (t / "mid.jsonl").write_bytes(content)
    c.run("the same file restored, --resume", ["pretrain", "--out", t / "mid", *common, "--resume"], expect=0)
    never_checkpointed(c)
    common = ["--steps", 4, "--eval-every", 2]
    c.run("a run stopped after 2 of 4 steps (for the full disk)", ["pretrain", "--out", t / "fsz", *common,
                                                                   "--stop-after", 2], expect=0)
    before = digest(t / "fsz/last.pt")
    c.run("--resume with a 1 MB file-size limit (last.pt is 6 MB)", ["pretrain", "--out", t / "fsz", *common,
                                                                      "--resume"], file_limit=2**20,
          check=lambda: (f"previous last.pt unchanged: {digest(t / 'fsz/last.pt') == before}; temp files left: "
                         f"{len(list((t / 'fsz').glob('.minimind-tmp*')))}"))
    c.run("--resume again, no limit", ["pretrain", "--out", t / "fsz", *common, "--resume"], expect=0)
    assert straight["code"] == 0


def never_checkpointed(c: Cases) -> None:
    """A run killed before its first checkpoint (config.json, no last.pt) is resumed from step 0."""
    t, run = c.t, ["--steps", 20, "--eval-every", 10]
    c.run("uninterrupted 20-step run (the reference)", ["pretrain", "--out", t / "ref20", *run], expect=0)
    proc = c.start(["pretrain", "--out", t / "early", *run, *TINY, *c.cache])
    wait_for(t / "early/config.json", proc)
    proc.send_signal(signal.SIGKILL)
    o, e = proc.communicate(timeout=600)
    c.record("SIGKILL before the first checkpoint", c.show(["minimind", "pretrain", "--out", t / "early", *run, *TINY]),
             proc.returncode, o, e, None, lambda: f"last.pt written: {(t / 'early/last.pt').exists()}")
    c.run("--resume of that run", ["pretrain", "--out", t / "early", *run, "--resume"], expect=0,
          check=lambda: (f"model.pth bit-identical to the uninterrupted run: "
                         f"{digest(t / 'early/model.pth') == digest(t / 'ref20/model.pth')}"))


def same_steps(a: Path, b: Path) -> str:
    """Whether two runs' metrics.csv hold the same steps with the same losses (timings differ, of course)."""
    import pandas as pd

    x, y = (pd.read_csv(d / "metrics.csv")[["step", "loss", "tokens", "val_loss"]] for d in (a, b))
    return "steps, losses, tokens equal" if x.equals(y) else f"DIFFER: {x.to_dict('list')} vs {y.to_dict('list')}"


def api_cases(c: Cases) -> None:
    prelude = "from minimind_lib.model import *; import torch; "
    for config in ("hidden_size=0", "intermediate_size=0", "intermediate_size=-1", "rope_theta=float('nan')",
                   "rms_norm_eps=-1"):
        c.run(f"MiniMindConfig({config})", [], python=prelude + f"MiniMindConfig({config})", expect=1)
    model = prelude + "m = MiniMindForCausalLM(MiniMindConfig.preset('smoke')); "
    for what, ids in [("float token ids", "torch.tensor([[1.0, 2.0]])"), ("1-D token ids", "torch.tensor([1, 2])"),
                      ("3-D token ids", "torch.ones(1, 2, 3).long()")]:
        c.run(what, [], python=model + f"m({ids})", expect=1)
    c.run("labels all -100", [], python=model + "m(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, -100, -100]]))",
          expect=1)
    nan = ("import sys; from minimind_lib import cli; from minimind_lib.model import MiniMindForCausalLM as M; f = "
           "M.forward; M.forward = lambda s, *a, **k: (o := f(s, *a, **k), s.training and setattr(o, 'logits', "
           "o.logits * float('nan')))[0]; sys.exit(cli.main(['pretrain', '--out', '" + str(c.t / "nan") + "', "
           "'--steps', '8', '--cache', '" + str(c.t / "cache") + "', " + ", ".join(f"'{a}'" for a in TINY) + "]))")
    c.run("every step's loss NaN (8 steps)", [], python=nan, expect=2,
          check=lambda: f"summary.json written: {(c.t / 'nan/summary.json').exists()}")
    c.run("a token id >= vocab_size", [], python=prelude + "MiniMindForCausalLM(MiniMindConfig.preset('smoke'))"
          "(torch.tensor([[1, 6400]]))", expect=1)
    gen = ("from minimind_lib.generate import generate_ids; m = MiniMindForCausalLM(MiniMindConfig.preset('smoke', "
           "max_position_embeddings=16)); ")
    c.run("generate: prompt fills every position", [], python=prelude + gen + "generate_ids(m, torch.ones(16).long())",
          expect=1)
    c.run("generate: 10 tokens asked, room for 2", [], python=prelude + gen + "print(generate_ids(m, "
          "torch.ones(14).long(), 10, temperature=0).shape)", expect=0)
    c.run("generate: temperature nan", [], python=prelude + gen + "generate_ids(m, torch.ones(4).long(), 2, "
          "temperature=float('nan'))", expect=1)


def export_cases(c: Cases) -> None:
    """Export and import-hf (issue 35): nothing of the user's is removed, every refusal names the path."""
    t = c.t
    c.run("export of a finished run", ["export", t / "pre", "--to", t / "hf"], expect=0)
    shutil.copytree(t / "hf", t / "hf2")
    users = {"notes.txt": "mine", ".lock": "my lock", ".x.tmp1": "my draft"}
    for name, text in users.items():
        (t / "hf2" / name).write_text(text)
    kept = lambda: all((t / "hf2" / n).read_text() == text for n, text in users.items())  # noqa: E731
    c.run("export --overwrite onto an earlier export holding the user's notes.txt, .lock, .x.tmp1",
          ["export", t / "pre", "--to", t / "hf2", "--overwrite"], check=lambda: f"user's files kept: {kept()}")
    c.run("the same, --allow-other-files", ["export", t / "pre", "--to", t / "hf2", "--overwrite",
                                            "--allow-other-files"], expect=0,
          check=lambda: f"user's files kept: {kept()}")
    for target in (".", ""):
        c.run(f"export --to {target or repr('')} --overwrite (the working directory)",
              ["export", t / "pre", "--to", target, "--overwrite"],
              check=lambda: f"nothing written in the working directory: {not (ROOT / 'config.json').exists()}")
    c.run("export --to a file", ["export", t / "pre", "--to", t / "afile"])
    (t / "hflink").symlink_to(t / "hf")
    c.run("export --to a symbolic link to an earlier export, --overwrite", ["export", t / "pre", "--to", t / "hflink",
                                                                             "--overwrite"], expect=0,
          check=lambda: f"still a link: {(t / 'hflink').is_symlink()}")
    c.run("import-hf --out '' (empty)", ["import-hf", t / "hf", "--out", ""],
          check=lambda: f"nothing written in the working directory: {not (ROOT / 'model.pth').exists()}")
    c.run("import-hf --out a file", ["import-hf", t / "hf", "--out", t / "afile"])
    c.run("import-hf onto an existing run, no --overwrite", ["import-hf", t / "hf", "--out", t / "pre"],
          check=lambda err: f"suggests --resume: {'--resume' in err}")
    c.run("import-hf --overwrite into a run directory a running pretrain holds (its lock)", [], python=(
        "import sys; from minimind_lib import cli; from minimind_lib.fileio import exclusive_dir; d = '" + str(t / "pre")
        + "'; lock = exclusive_dir(d); lock.__enter__(); sys.exit(cli.main(['import-hf', '" + str(t / "hf")
        + "', '--out', d, '--overwrite']))"), expect=2)
    for field, value in (("rms_norm_eps", -1), ("rope_theta", "abc")):
        hf = t / f"hf_{field}"
        shutil.copytree(t / "hf", hf)
        config = json.loads((hf / "config.json").read_text())
        config.update({field: value} if field != "rope_theta" else {"rope_parameters": {"rope_type": "default",
                                                                                        "rope_theta": value}})
        (hf / "config.json").write_text(json.dumps(config))
        c.run(f"import-hf of a config.json with {field} {value!r}", ["import-hf", hf, "--out", t / f"imp_{field}"],
              check=lambda: f"--out written: {(t / f'imp_{field}').exists()}")
    shutil.copytree(t / "pre", t / "abc")
    config = json.loads((t / "abc/config.json").read_text())
    config["model"]["rope_theta"] = "abc"
    (t / "abc/config.json").write_text(json.dumps(config))
    c.run("chat --ckpt a run whose config.json says rope_theta 'abc'", ["chat", "--ckpt", t / "abc", "--prompt", "hi"])
    c.run("chat --ckpt a file", ["chat", "--ckpt", t / "pre/model.pth", "--prompt", "hi"])


def shortfall_cases(c: Cases) -> None:
    """Runs that did less than asked say so (issue 35)."""
    t = c.t
    summary = lambda d: json.loads((t / d / "summary.json").read_text())  # noqa: E731
    c.run("pretrain --lr 1e6 --steps 8 (the gradients overflow)", ["pretrain", "--out", t / "lr", "--lr", "1e6",
                                                                  "--steps", 8],
          check=lambda: (f"summary.json shortfalls: {len(summary('lr')['shortfalls'])}; final_val_loss differs from "
                         f"the untrained model's: {summary('lr')['final_val_loss'] != summary('lr')['initial_val_loss']}"))
    c.run("the same, --allow-skipped-steps", ["pretrain", "--out", t / "lr2", "--lr", "1e6", "--steps", 8,
                                              "--allow-skipped-steps"], expect=0,
          check=lambda err: (f"warned on stderr: {'warning:' in err and 'steps were skipped' in err}; summary.json shortfalls: "
                             f"{len(summary('lr2')['shortfalls'])}"))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    c.data("tools.jsonl", [json.dumps({"conversations": [
        {"role": "system", "content": "You can add.", "tools": tools}, {"role": "user", "content": "3*4?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "mul", "arguments": "{}"}}]}, {"role": "tool", "content": "12"},
        {"role": "assistant", "content": "12."}]}) + "\n"])
    c.run("SFT data calling a tool the system turn never declared", [], python=(
        "from minimind_lib.corpus import JsonlReader; r = JsonlReader('" + str(t / "tools.jsonl") + "', kind='sft'); "
        "n = len(list(r)); print(n, r.counts()['n_undeclared_tool_calls'])"), expect=0)


# ------------------------------------------------------------------------------------------ issue 43
def strict(text: str) -> bool:
    """Whether text is one JSON value as strict parsers read it (no NaN, no Infinity)."""
    def refuse(constant):
        raise ValueError(constant)
    try:
        json.loads(text, parse_constant=refuse)
        return True
    except ValueError:
        return False


def conversation(system_words: int) -> str:
    system = [{"role": "system", "content": "word " * system_words}] if system_words else []
    return json.dumps({"conversations": system + [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "hello"}]}) + "\n"


def export_eval_cases(c: Cases) -> None:
    """1. eval prints numbers only for the model an export's files describe."""
    t = c.t
    edits = [("one layer fewer", {"num_hidden_layers": 1}), ("one layer more", {"num_hidden_layers": 3}),
             ("tie_word_embeddings false", {"tie_word_embeddings": False}), ("vocab_size 6401", {"vocab_size": 6401}),
             ("max_position_embeddings 2**62", {"max_position_embeddings": 2**62})]
    config = json.loads((t / "hf/config.json").read_text())
    texts = [(f"config.json says {what}", json.dumps({**config, **change})) for what, change in edits]
    for i, (what, text) in enumerate(texts + [("config.json is 5", "5"), ("config.json is {bad", "{bad"),
                                              ("model.safetensors is cut at 5000 bytes", None)]):
        hf = t / f"hf_edit{i}"
        shutil.copytree(t / "hf", hf)
        if text is None:
            (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:5000])
        else:
            (hf / "config.json").write_text(text)
        c.run(f"eval --json of an export whose {what}", ["eval", hf, "--json"],
              check=lambda: f"nothing on stdout: {c.last_out == ''}")
    c.run("import-hf of an export whose config.json says max_position_embeddings 2**62",
          ["import-hf", t / "hf_edit4", "--out", t / "imp_pos"],
          check=lambda: f"--out written: {(t / 'imp_pos').exists()}")
    shutil.copytree(t / "pre", t / "pos")
    config = json.loads((t / "pos/config.json").read_text())
    config["model"]["max_position_embeddings"] = 10**9
    (t / "pos/config.json").write_text(json.dumps(config))
    c.run("chat --ckpt a run whose config.json says max_position_embeddings 10**9",
          ["chat", "--ckpt", t / "pos", "--prompt", "hi"])


def sft_holdout_cases(c: Cases) -> None:
    """2. SFT holds out conversations that train something, and says before writing when too few do."""
    from minimind_lib.data import holdout_indices

    t, drawn = c.t, holdout_indices(40, 1337)[1]  # the rows the seed drew, before the rule
    c.data("late.jsonl", [conversation(100 if i in drawn else 0) for i in range(40)])
    c.run("sft where the seed's 5% answer past --seq-len (they used to be held out)",
          ["sft", "--out", t / "s_late", "--init", t / "pre", "--data", t / "late.jsonl", "--steps", 1], expect=0,
          check=lambda: "initial validation loss finite: " + str(math.isfinite(
              json.loads((t / "s_late/summary.json").read_text())["initial_val_loss"])))
    c.data("few.jsonl", [conversation(0 if i == 7 else 100) for i in range(20)])
    c.run("sft where 1 of 20 conversations trains a token within --seq-len",
          ["sft", "--out", t / "s_few", "--init", t / "pre", "--data", t / "few.jsonl", "--steps", 1],
          check=lambda: f"--out written: {(t / 's_few').exists()}")


def json_and_metrics_cases(c: Cases) -> None:
    """3. --json is strict JSON; 4. compare refuses an edited or cut metrics.csv."""
    t = c.t
    c.data("three.jsonl", [conversation(0)] * 3)
    c.run("eval --json with no assistant token within --seq-len 4", ["eval", t / "pre", "--data", t / "three.jsonl",
                                                                     "--seq-len", 4, "--replies", 1, "--json"],
          expect=3, check=lambda err: f"strict JSON: {strict(c.last_out)}; assistant_loss: "
                                      f"{json.loads(c.last_out)['chat']['assistant_loss']}")
    smoke = ["--profile", "smoke", "--no-progress", "--lr", 10, "--stop-after", 6, "--allow-skipped-steps"]
    c.run("a smoke-profile run at lr 10, stopped after 6 steps (used below)", ["pretrain", "--out", t / "huge",
                                                                                *smoke], expect=0, tiny=False)
    shutil.copytree(t / "huge", t / "inf", ignore=shutil.ignore_patterns("last.pt"))
    lines = (t / "inf/metrics.csv").read_text().split("\n")
    column = lines[0].split(",").index("val_loss")
    last = max(i for i, line in enumerate(lines[1:], 1) if line and line.split(",")[column])
    lines[last] = ",".join("inf" if k == column else v for k, v in enumerate(lines[last].split(",")))
    (t / "inf/metrics.csv").write_text("\n".join(lines))
    c.run("compare --json of a run whose last validation loss is inf", ["compare", t / "inf", "--json"], expect=1,
          check=lambda: f"strict JSON: {strict(c.last_out)}; nulls: {json.loads(c.last_out).get('nulls')}")
    for name, edit in [("cut mid-row", lambda b: b[:-7]), ("'0x' in step", ("step", 2, "0x")),
                       ("'abc' in val_loss", ("val_loss", 1, "abc")), ("'lots' in tokens", ("tokens", 3, "lots")),
                       ("its last row removed", lambda b: b"\n".join(b.split(b"\n")[:-2]) + b"\n")]:
        run = t / f"m_{len(c.rows)}"
        shutil.copytree(t / "pre", run)
        data = (run / "metrics.csv").read_bytes()
        if isinstance(edit, tuple):
            rows = [r.split(b",") for r in data.split(b"\n")]
            rows[edit[1]][rows[0].index(edit[0].encode())] = edit[2].encode()
            data = b"\n".join(b",".join(r) for r in rows)
        else:
            data = edit(data)
        (run / "metrics.csv").write_bytes(data)
        c.run(f"compare of a metrics.csv {name}", ["compare", run, "--json"])


def handout_cases(c: Cases) -> None:
    """5. make handout: a kill leaves a rerun that works and no temp file; a forged manifest deletes nothing."""
    t, tool = c.t, [sys.executable, ROOT / "tools" / "handout.py", "--out"]
    c.run("make handout (the reference)", [], argv=[*tool, t / "ref_handout"], expect=0)
    proc = subprocess.Popen([str(a) for a in [*tool, t / "handout"]], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(t / "handout/lab/03_model.ipynb", proc)  # some files written, others not yet
    proc.send_signal(signal.SIGKILL)
    o, e = proc.communicate(timeout=600)
    c.record("SIGKILL during make handout", c.local(f"python tools/handout.py --out {t / 'handout'}"),
             proc.returncode, o, e, None, lambda: f"temp files left: {len(list((t / 'handout').rglob('.minimind-tmp*')))}")
    c.run("make handout again", [], argv=[*tool, t / "handout"], expect=0, check=lambda: (
        f"temp files left: {len(list((t / 'handout').rglob('.minimind-tmp*')))}; every file as in the reference: "
        f"{snapshot(t / 'handout') == snapshot(t / 'ref_handout')}"))
    (t / "handout/lab/mine.ipynb").write_text("the learner's")
    (t / "outside").mkdir()
    (t / "outside/03_model.ipynb").write_text("not the handout's")
    (t / "handout/old").symlink_to(t / "outside", target_is_directory=True)
    manifest = json.loads((t / "handout/.handout-manifest.json").read_text())
    manifest["files"].update({"lab/mine.ipynb": digest(t / "handout/lab/mine.ipynb"),
                              "old/03_model.ipynb": digest(t / "outside/03_model.ipynb")})
    (t / "handout/.handout-manifest.json").write_text(json.dumps(manifest))
    c.run("make handout with a manifest listing the learner's file and one through a linked folder, their true "
          "SHA-256s", [], argv=[*tool, t / "handout"], expect=0, check=lambda: (
              f"learner's file kept: {(t / 'handout/lab/mine.ipynb').exists()}; file outside kept: "
              f"{(t / 'outside/03_model.ipynb').exists()}"))
    c.run("make handout with a 1 MB file-size limit", [], argv=[*tool, t / "handout_fsz"], file_limit=2**20)
    c.run("make handout again, no limit", [], argv=[*tool, t / "handout_fsz"], expect=0, check=lambda: (
        f"temp files left: {len(list((t / 'handout_fsz').rglob('.minimind-tmp*')))}"))
    (t / "ro_handout").mkdir(mode=0o555)
    c.run("make handout into a read-only folder", [], argv=[*tool, t / "ro_handout"], wrap=NO_DAC_OVERRIDE)
    (t / "ro_handout").chmod(0o755)


# root reads and writes any folder; without these capabilities it meets a folder's permissions, as a user does
NO_DAC_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


def system_error_cases(c: Cases) -> None:
    """6. read-only folders, a non-UTF-8 --out, a full disk and a folder in the way: one sentence each."""
    t = c.t
    (t / "ro").mkdir()
    shutil.copytree(t / "pre", t / "ro/run")
    shutil.copytree(t / "hf", t / "ro/hf")
    for d in ("ro", "ro/run", "ro/hf"):
        (t / d).chmod(0o555)
    before = snapshot(t / "ro")
    unchanged = lambda: f"read-only folder unchanged: {snapshot(t / 'ro') == before}"  # noqa: E731
    for what, args in [("pretrain into", ["pretrain", "--out", t / "ro/new", "--steps", 1]),
                       ("pretrain --resume of a run in", ["pretrain", "--out", t / "ro/run", "--steps", 4, "--resume"]),
                       ("export into", ["export", t / "pre", "--to", t / "ro/hf2"]),
                       ("export --overwrite of an export in", ["export", t / "pre", "--to", t / "ro/hf", "--overwrite"]),
                       ("import-hf into", ["import-hf", t / "hf", "--out", t / "ro/imported"])]:
        c.run(f"{what} a read-only folder", args, wrap=NO_DAC_OVERRIDE, check=unchanged)
    for d in ("ro", "ro/run", "ro/hf"):
        (t / d).chmod(0o755)
    bad = os.fsdecode(os.fsencode(str(t)) + b"/run\xff")
    c.run("pretrain --out with a byte that is not UTF-8", ["pretrain", "--out", bad, "--steps", 1],
          check=lambda: f"--out written: {os.path.exists(bad)}")
    c.run("export with a 1 MB file-size limit (model.safetensors is 2 MB)", ["export", t / "pre", "--to",
                                                                           t / "hf_fsz"], file_limit=2**20,
          check=lambda: f"--to written: {(t / 'hf_fsz').exists()}")
    shutil.copytree(t / "hf", t / "hf_dir")
    (t / "hf_dir/model.safetensors").unlink()
    (t / "hf_dir/model.safetensors").mkdir()
    config = digest(t / "hf_dir/config.json")
    c.run("export --overwrite onto an earlier export whose model.safetensors is now the user's folder",
          ["export", t / "pre", "--to", t / "hf_dir", "--overwrite"],
          check=lambda: f"config.json unchanged: {digest(t / 'hf_dir/config.json') == config}")


def role_cases(c: Cases) -> None:
    """7. SFT data with roles out of order is refused with file:line; MiniMind-3's tool turns are kept."""
    t = c.t
    line = lambda *roles: json.dumps({"conversations": [{"role": r, "content": f"a {r} turn"}  # noqa: E731
                                                        for r in roles]}) + "\n"
    for what, roles in [("assistant first", ("assistant", "user", "assistant")),
                        ("user then user", ("user", "user", "assistant")),
                        ("assistant then assistant", ("user", "assistant", "assistant"))]:
        data = c.data(f"roles_{len(c.rows)}.jsonl", [line("user", "assistant"), line(*roles)])
        c.run(f"SFT data: {what}", ["sft", "--out", t / "s_roles", "--init", t / "pre", "--data", data, "--steps", 1])
    data = c.data("late_system.jsonl", [line("user", "assistant", "system", "user", "assistant")])
    c.run("SFT data: a system turn in the middle (MiniMind-3's template renders it)", [], python=(
        "from minimind_lib.corpus import JsonlReader; r = JsonlReader('" + str(data) + "', kind='sft'); n = "
        "len(list(r)); print(n, r.counts()['n_late_system_turns'])"), expect=0)
    c.run("SFT data with MiniMind-3's tool turns (sft_t2t_mini.jsonl)", [], python=(
        "from minimind_lib.corpus import JsonlReader; print(len(list(JsonlReader('data/sft_t2t_mini.jsonl', "
        "kind='sft'))))"), expect=0)


def tool_cases(c: Cases) -> None:
    """8. The benchmarks and tools refuse bad arguments in one line, and zero is never read as the default."""
    t = c.t
    bench = [sys.executable, "-m", "benchmarks"]
    empty = c.data("empty_bench.jsonl", [])
    for what, args in [("--batch -1", ["accumulation", "--batch", -1]), ("--k 0", ["accumulation", "--k", 0]),
                       ("--profile bogus", ["accumulation", "--profile", "bogus"]),
                       ("--batches 0", ["batching", "--batches", 0]),
                       ("--data a missing file", ["memmap", "--data", t / "missing.jsonl"]),
                       ("--seq-len 0", ["memmap", "--seq-len", 0]), ("--steps 0", ["throughput", "--steps", 0]),
                       ("--data an empty file", ["throughput", "--profile", "smoke", "--data", empty])]:
        c.run(f"benchmarks {args[0]} {what}", [], argv=[*bench, *args])
    if not torch.cuda.is_available():
        for name in ("accumulation", "throughput"):
            c.run(f"benchmarks {name} --device cuda without CUDA", [], argv=[*bench, name, "--device", "cuda",
                                                                              "--profile", "smoke"])
    (t / "existing").mkdir()
    tools = ROOT / "tools"
    c.run("make_reference.py --work an existing folder", [], argv=[sys.executable, tools / "make_reference.py", "smoke",
                                                                  "--work", t / "existing"])
    c.run("run_course.py --out a file", [], argv=[sys.executable, tools / "run_course.py", "--out", t / "afile"])
    c.run("run_course.py --only 99", [], argv=[sys.executable, tools / "run_course.py", "--out", t / "rc", "--only",
                                               99], check=lambda: f"--out written: {(t / 'rc').exists()}")
    c.run("doc_numbers.py of a missing file", [], argv=[sys.executable, tools / "doc_numbers.py", t / "missing.md"])


def long_line_case(c: Cases) -> None:
    """9. A long single-line document is tokenized in bounded pieces."""
    text = "\n".join(json.loads(line)["text"] for line in (DATA / "pretrain.jsonl").open(encoding="utf-8"))
    (c.t / "long.jsonl").write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n", encoding="utf-8")
    c.run(f"tokenize a single-line jsonl of {(c.t / 'long.jsonl').stat().st_size / 1e6:.0f} MB", [], python=(
        "import resource; from minimind_lib.corpus import tokenize_to_memmap; from minimind_lib.tokenizer import "
        "load_tokenizer; i = tokenize_to_memmap('" + str(c.t / "long.jsonl") + "', load_tokenizer(), '"
        + str(c.t / "long") + "', num_workers=0, progress=False); print(i.n_tokens, 'tokens; peak RSS', "
        "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, 'MB')"), expect=0)


def issue43_cases(c: Cases) -> None:
    export_eval_cases(c)
    sft_holdout_cases(c)
    json_and_metrics_cases(c)
    handout_cases(c)
    system_error_cases(c)
    role_cases(c)
    tool_cases(c)
    long_line_case(c)


CHOICES = [
    "Files the program leaves beside a user's start with `.minimind-` (the lock `.minimind-lock`, temp files "
    "`.minimind-tmp.*`). Leftover temp files are removed only from a folder whose `config.json` is a run of this "
    "program, and `--overwrite` refuses a folder that is not one: nothing else in `--out` is ever removed.",
    "A data file's fingerprint is its size and the SHA-1 of its whole content, streamed. The tokenizer cache and the "
    "`--resume` check use the same function (`fileio.file_fingerprint`), so they cannot disagree; a run hashes each "
    "data file twice (its config, its cache). `python -m benchmarks memmap --json` reports the cost on a 1 GB file "
    "(`fingerprint_s_median`). Runs recorded with the older head-and-tail fingerprint cannot be resumed.",
    "A step is *applied* when it moved the weights: not a NaN/inf step, not an fp16 step the GradScaler skipped, not a "
    "step without trained tokens. `summary.json`'s `steps` and `tokens` and `metrics.csv`'s `tokens_seen` count applied "
    "steps only (and none a NaN rollback undid); `skipped_steps` lists the others. A run with no applied step fails.",
    "A micro-batch whose labels are all -100 is not run (under DDP it is, adding 0, as every rank must take part in the "
    "gradient sync); a step with none is skipped without an optimizer step (AdamW's momentum and weight decay would "
    "still move the weights) and does not count towards a NaN rollback.",
    "`model(ids, labels=...)` with every label -100 raises and says why the loss is undefined, for labels on the CPU; "
    "on a GPU the check would make the host wait for the device at every forward, so the loss there is NaN as in torch.",
    "A run directory with `config.json` but no `last.pt` (stopped before its first checkpoint) is resumed from step 0 "
    "with its recorded settings (`--resume` says so and checks them like any resume).",
    "A write that fails for lack of space or the file-size limit names the file and the reason; the temp file is "
    "removed and the previous file (e.g. `last.pt`) stays as it was.",
    "Samples are generated before the checkpoint of their step and stored in `last.pt`; `samples.jsonl` and "
    "`metrics.csv` are rewritten after each checkpoint from what it holds, so a kill never separates them.",
    "`export` writes each file whole in `.minimind-tmp.export` inside the target, lists them in "
    "`.minimind-export.json`, then moves them in one by one: `--overwrite` replaces only the files that list names, an "
    "old file stays until its new one is whole, and a folder holding anything else is refused unless "
    "`--allow-other-files` (which writes beside those files, never over them). The working directory is never a target.",
    "A run that skipped steps (NaN/inf, or no trained tokens: not the GradScaler's fp16 skips, its normal search for a "
    "scale) or ends with no evaluation of its final model lists why in `summary.json`'s `shortfalls`, and exits 2 "
    "unless `--allow-skipped-steps` (then it warns on stderr). The final model is evaluated after the loop whenever "
    "the last step left no validation loss, so `final_val_loss` is always the saved model's.",
    "`eval` of a transformers export first reads it as `import-hf` does (config.json's fields, the tokenizer's vocab, "
    "every weight's name and shape against the model config.json describes), then loads it with transformers and "
    "refuses it if transformers reports a missing, unexpected or mis-shaped weight: a table is printed only for the "
    "model the files name. `max_position_embeddings` is at most 131,072 (the rotary tables hold a row per position).",
    "SFT holds out 5% of the conversations that train something (an assistant token within `seq_len`): the same "
    "draw as before, skipping those that train nothing, so a file where every conversation trains holds out the same "
    "rows. A file with too few such conversations is refused before anything is written, naming their lines, where "
    "their first answer starts and the `--seq-len` that would reach it.",
    "`--json` is strict JSON: a NaN or infinite value is written as null and named in `nulls`; a measurement that "
    "cannot be made (no assistant token within the context) is null with its reason beside it, and `eval` then "
    "exits 3. `compare` refuses a `metrics.csv` whose last row has no end of line, whose row lacks fields, whose cell "
    "is not a number, or which holds fewer trained tokens than the run's `summary.json` says it trained.",
    "`make handout` writes its manifest before it replaces the first file, listing for each file both the SHA-256 "
    "it has and the one it will have: a kill at any point leaves a folder the next run accepts, and that run removes "
    "the temp files the killed one left. It removes an earlier handout's file only when it is of a kind the handout "
    "writes (a chapter, a file beside them, a solution, a data file), unchanged, and inside the handout folder once "
    "links are resolved; it never writes through a folder that links elsewhere.",
    "An OS error reaches the user as one sentence naming the path and what to do (permission denied, read-only file "
    "system, no space, the file-size limit, a folder where a file is needed), from every command, the benchmarks and "
    "the tools. Paths a run records must be UTF-8.",
    "SFT data is refused (file:line) when an answer has no user turn before it or two user or two assistant turns "
    "follow each other; a system turn after the first is kept, as MiniMind-3's template renders it, and counted "
    "(`n_late_system_turns`) with a warning naming the first line.",
    "A text longer than 262,144 characters is encoded in pieces cut where the tokenizer splits anyway (around a "
    "special token, or where its pre-tokenizer starts a word), so the ids are those of the whole text and the "
    "encoder holds one piece at a time.",
]


def write_table(rows: list, path: Path) -> None:
    lines = ["# Reliability: what a user's mistakes and accidents get", "",
             "Generated by `python tools/reliability_cases.py` (do not edit by hand): each row ran as written, in a "
             "fresh process, in the smoke profile on tiny sizes (`TINY` = `" + " ".join(TINY) + "`), in a temporary "
             "folder `T` where `T/pre` is a finished 2-step pretraining run. `minimind` stands for `python -m "
             "minimind_lib`. *as promised* means the exit code is the expected one (0 for a run meant to succeed, 2 "
             "for a refused input, 1 for a library call that raises or a run `compare` finds diverged, 3 for a "
             "measurement `eval` cannot make, -9 for a process killed on purpose) with no traceback.", "",
             f"{len(rows)} cases, {sum(r[4] == 'yes' for r in rows)} as promised.", "",
             "| case | command | exit | first error line (or what was checked) | as promised |",
             "|---|---|---|---|---|"]
    lines += [f"| {case} | `{cmd}` | {code} | {what} | {ok} |" for case, cmd, code, what, ok in rows]
    lines += ["", "## Choices made", ""] + [f"- {choice}" for choice in CHOICES]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "reliability.md"))
    args = parser.parse_args()
    pre_lines = (DATA / "pretrain.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
        c = Cases(Path(tmp))
        c.run("a 2-step pretraining run (used below)", ["pretrain", "--out", c.t / "pre", "--steps", 2], expect=0)
        data_cases(c, pre_lines)
        flag_cases(c)
        out_dir_cases(c)
        checkpoint_cases(c)
        kill_cases(c, pre_lines)
        api_cases(c)
        export_cases(c)
        shortfall_cases(c)
        issue43_cases(c)
    write_table(c.rows, Path(args.out))
    print(f"wrote {args.out}: {len(c.rows)} cases, {sum(r[4] != 'yes' for r in c.rows)} not as promised")
    return 0


if __name__ == "__main__":
    sys.exit(main())
