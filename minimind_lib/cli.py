"""The command line of notebooks 07_pretrain, 08_sft and 10_lora_dpo: `python -m minimind_lib
info|pretrain|sft|lora|dpo|chat|export|import-hf|compare|eval`.

It calls the same functions as the notebooks (pipeline.pretrain/sft, checkpoint.load_run,
generate.chat): no copy of their logic; `--help` on each command lists its options. Every bad input
(a zero or negative size, missing or corrupt data or checkpoint, tokenizer/model vocab mismatch,
--resume with other settings or changed data, an --out in use by another run) prints one `error:
...` line on stderr and exits with code 2, before anything in --out is written. `compare` exits 1
for a run above its band or diverged; `eval` and `compare` exit 3 when a measurement is missing
(--json writes it as null, with the reason beside it: JSON has no NaN or infinity). Ctrl-C or
SIGTERM during training ends the run after the current step with a checkpoint (continue with
--resume).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from .checkpoint import RunError, load_run
from .device import device_report, get_device
from .evaluate import compare_run, describe_ladder, evaluate_model
from .export import DTYPES, export_run, import_hf
from .fileio import explain
from .generate import chat
from .loggers import LOGGERS
from .model import PRESETS
from .pipeline import RunSettings, dpo, lora, pretrain, sft
from .profiles import get_profile


def number(kind: type, low: float, low_ok: bool = True):
    """An argparse type: a finite `kind` >= low (> low when not low_ok), refused with the rule it
    breaks."""
    def parse(text: str):
        # not a number: argparse says "invalid integer value: 'x'" (the function's name)
        value = kind(text)
        if not math.isfinite(value) or value < low or (value == low and not low_ok):
            raise argparse.ArgumentTypeError(
                f"{text}: must be "
                f"{'an integer' if kind is int else 'a finite number'} "
                f"{'>=' if low_ok else '>'} {low}"
            )
        return value
    parse.__name__ = "integer" if kind is int else "number"
    return parse


POSITIVE, NON_NEGATIVE = number(int, 1), number(int, 0)


def device(text: str) -> str:
    """An argparse type: a device torch can parse, else the forms it takes."""
    try:
        return str(torch.device(text))
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda, cuda:N (N: a "
                                         "GPU's index) or mps")


def _add_stage_args(p: argparse.ArgumentParser, stage: str) -> None:
    """The options of one stage: where it starts from, its model or its adapters."""
    if stage == "pretrain":
        p.add_argument("--config", default=None,
                       help=f"model preset: {', '.join(PRESETS)} (default: the profile's)")
        p.add_argument("--tokenizer", dest="tokenizer_dir",
                       help="tokenizer directory (default: the bundled 6400-token one)")
    elif stage == "sft":
        p.add_argument("--init", required=True, help="the pretraining run directory to start from")
    else:
        dpo, positive = stage == "dpo", number(float, 0.0, low_ok=False)
        start = " (SFT's); also the frozen reference" if dpo else " (its weights stay frozen)"
        rank = " (default: DPO trains every weight)" if dpo else " (default 8)"
        p.add_argument("--from", dest="init", required=True, metavar="RUN",
                       help="the run directory to start from" + start)
        p.add_argument("--lora-rank", type=POSITIVE, default=None if dpo else 8,
                       help="LoRA adapters of this rank beside the square Linears (q_proj, "
                       "o_proj), the rest frozen" + rank)
        p.add_argument("--lora-alpha", type=positive, default=None,
                       help="the adapters' scale is alpha / rank (default: alpha = rank, scale 1)")
    if stage == "lora":
        p.add_argument("--merge", action="store_true", help="also write model.pth, adapters merged")
    if stage == "dpo":
        p.add_argument("--beta", type=positive, default=0.1,
                       help="the DPO loss's beta (default 0.1): larger stays nearer the reference")


def _add_train_args(p: argparse.ArgumentParser, stage: str) -> None:
    default = {"lora": "sft"}.get(stage, stage)
    p.add_argument("--data", default=None,
                   help=f"jsonl file (default: data/{default}.jsonl); MiniMind's own files work")
    p.add_argument("--out", required=True,
                   help="run directory to write (config.json, model.pth, tokenizer/, metrics.csv, "
                        "last.pt)")
    p.add_argument("--profile", default=None,
                   help="sizes from this profile: smoke, workshop, cpu, gpu (default: "
                        "MINIMIND_PROFILE or auto)")
    _add_stage_args(p, stage)
    p.add_argument("--max-tokens", type=POSITIVE,
                   help="padded tokens per micro-batch (default: the profile's)")
    p.add_argument("--accum", dest="accum_steps", type=POSITIVE,
                   help="micro-batches per step (default: the profile's)")
    p.add_argument("--amp", choices=("auto", "bf16", "fp16", "off"), default="auto",
                   help="mixed precision (default: auto)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="torch.compile the model (default: the profile's)")
    p.add_argument("--loss-chunk", type=NON_NEGATIVE,
                   help="positions per chunk of the chunked loss (0: off; default: the profile's)")
    p.add_argument("--steps", type=POSITIVE, help="optimizer steps (default: the profile's)")
    p.add_argument("--lr", type=number(float, 0.0, low_ok=False),
                   help="peak learning rate (default: the profile's)")
    p.add_argument("--seq-len", type=POSITIVE,
                   help="longest sample in tokens (default: the profile's)")
    p.add_argument("--val-data", default=None,
                   help="validation jsonl (pretrain default: data/pretrain_val.jsonl)")
    p.add_argument("--val-batches", type=POSITIVE, default=4,
                   help="validation micro-batches per eval (default 4)")
    p.add_argument("--eval-every", type=POSITIVE,
                   help="optimizer steps between validations (default: the profile's)")
    p.add_argument("--cache", dest="cache_dir",
                   help="memmap cache directory (default: next to --out)")
    p.add_argument("--max-samples", type=NON_NEGATIVE,
                   help="read at most N samples (0: all; default: the profile's)")
    p.add_argument("--device", type=device, default=None,
                   help="cuda, cuda:N, mps or cpu (default: the best available)")
    p.add_argument("--resume", action="store_true",
                   help="continue --out from its last.pt (same settings required)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    p.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                   help="a bad data line: stop with its file:line (default), or skip it (counted "
                        "and logged)")
    p.add_argument("--stop-after", type=POSITIVE, default=None,
                   help="stop (with a checkpoint) after N steps of the --steps schedule; continue "
                        "later with --resume")
    p.add_argument("--allow-skipped-steps", action="store_true",
                   help="exit 0 despite skipped steps (still reported)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_log_option(p)
    p.set_defaults(func=cmd_train)


def add_log_option(p: argparse.ArgumentParser) -> None:
    """--log tensorboard|wandb, repeatable: where a training command's metrics go too."""
    p.add_argument("--log", dest="loggers", action="append", default=[], choices=list(LOGGERS),
                   help="also send the metrics to TensorBoard (OUT/tensorboard/: make "
                   "tensorboard RUN=OUT) or Weights & Biases (offline unless WANDB_MODE says "
                   "otherwise: OUT/wandb/); repeat for both; at the end, compare's verdict and "
                   "eval's ladder too")


def run_report(out: Path) -> dict:
    """A logged run's last numbers: compare's verdict and eval's ladder (or why there is none)."""
    report = {}
    for name, measure in (("band", compare_run), ("ladder", evaluate_model)):
        try:
            report[name] = measure(out)
        except (RunError, FileNotFoundError) as e:  # no band for these settings, too few documents
            report[name] = {"error": str(e)}
    keep = ("verdict", "summary", "error")
    report["band"] = {k: v for k, v in report["band"].items() if k in keep}
    return report


def _train_kwargs(args: argparse.Namespace) -> dict:
    """pretrain/sft's keyword arguments: the options named as RunSettings' fields, the progress
    bars, the log."""
    known = {f.name for f in fields(RunSettings)}
    return {**{k: v for k, v in vars(args).items() if k in known}, "progress": not args.no_progress,
            "log": lambda msg: print(msg, file=sys.stderr, flush=True), "report": run_report}


def cmd_info(args: argparse.Namespace) -> int:
    """Print the device report (with the selected profile) as JSON."""
    print(json.dumps(device_report(profile=get_profile(args.profile)), indent=None if args.compact
                     else 2))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Pretrain (or fine-tune: sft --init, lora, dpo --from) into --out; print its summary."""
    run = {"pretrain": pretrain, "sft": sft, "lora": lora, "dpo": dpo}[args.command]
    result = run(**_train_kwargs(args))
    # Under torchrun every rank returns; only rank 0 has the whole summary (the process group is
    # gone by now, so
    # ask torchrun's environment rather than torch.distributed).
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"out": str(result.out_dir), **result.summary}, indent=2, default=str))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """One answer with --prompt; otherwise a REPL when stdin is a terminal, else one answer per
    stdin line."""
    device = None  # the model stays on the CPU
    if args.device is not None:
        device = get_device(args.device)  # refuses a device this machine lacks
    model, tok, _ = load_run(args.ckpt, device=device)
    opts = dict(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                seed=args.seed)
    if args.prompt is not None:
        print(chat(args.prompt, model, tok, **opts))
        return 0
    tty = sys.stdin.isatty()
    # a terminal's conversation goes on; piped lines are answered one by one
    history: list[dict] = []
    if tty:
        print("chat with the model (Ctrl-D or /exit to quit, /reset to forget the conversation)",
              file=sys.stderr)
    while True:
        try:
            line = input("you> " if tty else "").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
        elif line and tty:
            print("model> ", end="", flush=True)
            chat(line, model, tok, history=history, stream=lambda s: print(s, end="", flush=True),
                 **opts)
            print()
        elif line:
            print(chat(line, model, tok, **opts), flush=True)


def cmd_export(args: argparse.Namespace) -> int:
    """`export`: a run directory to the transformers format; `import-hf`: such a directory to a run
    directory."""
    if args.command == "export":
        print(export_run(args.run_dir, args.to, args.dtype, args.overwrite,
                         args.allow_other_files, args.adapter))
    else:
        print(import_hf(args.hf_dir, args.out, args.overwrite, args.allow_other_files))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """`compare`: a run's verdict against its band (exit 1: above or diverged); `eval`: the
    evaluation ladder."""
    if args.command == "compare":
        r = compare_run(args.path)
        text = "\n".join([r["summary"], *(f"  {f['cause']}: {f['evidence']}"
                                          for f in r["findings"]),
                          *(f"  note: {n}" for n in r["notes"])])
    else:
        r = evaluate_model(args.path, args.data, args.seq_len, replies=args.replies)
        text = describe_ladder(r)
    nulls: dict = {}
    r = strict_json(r, "", nulls)
    if nulls:
        r["nulls"] = {where: f"{value}: not a number JSON holds, written as null"
                      for where, value in nulls.items()}
    if args.json:
        text = json.dumps(r, indent=2, ensure_ascii=False, default=str, allow_nan=False)
    print(text)
    return r.get("exit_code") or (3 if nulls else 0)


def strict_json(value: Any, where: str, nulls: dict) -> Any:
    """`value` with each NaN or infinite float as None (JSON has neither), its place and value noted
    in `nulls`."""
    if isinstance(value, dict):
        return {k: strict_json(v, f"{where}.{k}".lstrip("."), nulls) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v, f"{where}[{i}]", nulls) for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        nulls[where] = str(value)
        return None
    return value


def add_subcommands(subparsers) -> None:
    """Register info, pretrain, sft, lora, dpo, chat, export, import-hf, compare and eval on a
    subparsers object."""
    i = subparsers.add_parser("info", help="print device and profile facts as JSON")
    i.add_argument("--profile", default=None,
                   help="profile name (default: MINIMIND_PROFILE or auto)")
    i.add_argument("--compact", action="store_true", help="one-line JSON")
    i.set_defaults(func=cmd_info)
    for stage, what in (("pretrain", "pretrain a MiniMind model on a {'text'} jsonl file"),
                        ("sft", "supervised fine-tuning on a {'conversations'} jsonl file"),
                        ("lora", "SFT through LoRA adapters (lora.pth; --merge: also model.pth)"),
                        ("dpo", "DPO on a {'chosen', 'rejected'} jsonl file (MiniMind's format)")):
        _add_train_args(subparsers.add_parser(stage, help=what), stage)
    c = subparsers.add_parser("chat", help="chat with a trained run directory")
    c.add_argument("--ckpt", required=True,
                   help="a run directory (config.json, model.pth, tokenizer/)")
    c.add_argument("--prompt", default=None, help="answer this one prompt and exit")
    c.add_argument("--temperature", type=number(float, 0.0), default=0.7,
                   help="0 = greedy (default 0.7)")
    c.add_argument("--top-p", type=number(float, 0.0, low_ok=False), default=0.9)
    c.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    c.add_argument("--seed", type=int, default=None,
                   help="fix the sampling: same seed, same answer")
    c.add_argument("--device", type=device, default=None,
                   help="cuda, cuda:N, mps or cpu (default: cpu)")
    c.set_defaults(func=cmd_chat)
    _add_export_args(subparsers)
    m = subparsers.add_parser("compare",
                              help="is a run healthy? its validation loss against its profile's "
                                   "band")
    v = subparsers.add_parser("eval",
                              help="what did a model learn? the evaluation ladder on held-out data")
    v.add_argument("--data", default=None,
                   help="a {'text'} jsonl for the held-out text, or a {'conversations'} "
                   "jsonl for the held-out conversations (default: the run's held-out data)")
    v.add_argument("--seq-len", type=POSITIVE, default=None,
                   help="context in tokens (default: the run's seq_len)")
    v.add_argument("--replies", type=POSITIVE, default=100,
                   help="greedy replies after SFT, at most (default 100)")
    for parser, what in ((m, "a run directory (config.json, metrics.csv)"),
                         (v, "a run directory, or a transformers directory written by export")):
        parser.add_argument("path", help=what)
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        parser.set_defaults(func=cmd_health)


def _add_export_args(subparsers) -> None:
    """The export and import-hf commands."""
    e = subparsers.add_parser(
        "export", help="write a run as a transformers model (Llama, Qwen3 or Qwen3-MoE)"
    )
    e.add_argument("run_dir", help="a finished run directory (config.json, model.pth, tokenizer/)")
    e.add_argument("--to", required=True,
                   help="directory to write: config.json, model.safetensors, tokenizer files")
    e.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="precision of the weights (default fp32)")
    e.add_argument("--adapter", action="store_true",
                   help="a LoRA run's adapters only, as a PEFT adapter directory (adapter_config"
                   ".json, adapter_model.safetensors) for the export of the run it started from")
    h = subparsers.add_parser("import-hf",
                              help="a transformers Llama/Qwen3/Qwen3-MoE directory to a run "
                                   "directory")
    h.add_argument("hf_dir",
                   help="a transformers model directory (config.json, model.safetensors, tokenizer "
                        "files)")
    h.add_argument("--out", required=True,
                   help="the run directory to write (config.json, model.pth, tokenizer/)")
    for parser, what in ((e, "the files an earlier export wrote there"),
                         (h, "the run in --out (a run of ours only)")):
        parser.add_argument("--overwrite", action="store_true", help=f"replace {what}")
        parser.add_argument("--allow-other-files", action="store_true",
                            help="write beside files it did not write")
        parser.set_defaults(func=cmd_export)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m minimind_lib` (one subcommand per task)."""
    parser = argparse.ArgumentParser(prog="python -m minimind_lib",
                                     description=__doc__.splitlines()[0])
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse argv and run the command; bad input becomes `error: ...` on stderr and exit code 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError, OSError) as exc:
        print(f"error: {explain(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside training (tokenizing, loading): nothing to checkpoint yet
        print("error: interrupted", file=sys.stderr)
        return 130
