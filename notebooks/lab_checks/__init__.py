"""The lab edition's checks: this engine, and a table of regions per chapter (chNN_*.py beside it; a chapter adds one).

`X = lab.check(name, X)` after a region: a stub (nbgrader's, left by tools/handout.py) gets "not written yet", a hint
and the library's rule; written code runs on the region's fixed cases (each usual mistake shows on one; they decide, so
the same code gets the same verdict every time), then on random ones, against the library. The first difference is
named in the learner's terms; a usual mistake only when running it (the reference with one edit) gives exactly what
the learner's code gives. Another region's failed object that the code uses (Block builds RMSNorm) is replaced by the
library's rule while it is checked, and the message says so.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import dis
import functools
import importlib
import inspect
import math
import os
import pkgutil
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from exercise_checks import NotRightYet

NOT_WRITTEN, PASSED = "not written yet", "passed"
REGIONS: dict[str, "Region"] = {}
HISTORY: dict[Any, tuple[str, str]] = {}  # an object a check saw -> (its region, "passed", "failed" or "library")


class Case:
    """One input of a check: what it is in the learner's words, the arguments, its own tolerance if any."""
    def __init__(self, what: str, *args: Any, tol: Any = None):
        self.what, self.args, self.tol = what, args, tol


@dataclass
class Share:  # float32 math cast to bfloat16 at the end: all within `loose`, at most a `share` beyond `tight`
    tight: float
    loose: float
    share: float


@dataclass
class Region:
    name: str  # as tools/handout.py names it: the def around the region ("RMSNorm.forward")
    hint: str  # where to look, never the answer
    reference: Callable  # the library's function; for a method region, the library's rule as that method
    fixed: Callable[[], list]  # () -> the fixed cases
    drawn: Callable = lambda g: []  # a torch.Generator -> random cases
    run: Callable = lambda fn, case: fn(*copy.deepcopy(case.args))  # an implementation, a case -> its output(s)
    mistakes: tuple = ()  # (what it is, the wrong version, or (old, new) edits of the reference's source)
    tol: Any = 1e-5  # relative and absolute, a Share, or {output name: tolerance}
    method: str | None = None  # a method region: run gets a class
    output: str = "the result"  # the name of run's output, unless run returns a dict of named outputs
    axes: tuple = ()  # the names of an output tensor's axes
    reading: Callable | None = None  # (case, index) -> what such a difference usually means
    ready_made: tuple = ()  # dotted names doing the same mechanism (tools/handout.py --grade flags a call to one)
    around: Callable = contextlib.nullcontext  # what every run of the check needs (09: a process group)


def edited(fn: Callable, *pairs: tuple[str, str], **names: Any) -> Callable:
    """`fn` with one usual mistake: its source with each (old, new) replaced; LookupError if old is not in it."""
    @functools.cache
    def build() -> Callable:
        source = textwrap.dedent(inspect.getsource(fn))
        for old, new in pairs:
            if old not in source:
                raise LookupError(f"{old!r} is not in the source of {fn.__qualname__}")
            source = source.replace(old, new)
        scope = {**inspect.unwrap(fn).__globals__, **names}
        exec(compile(source, f"<{fn.__qualname__} with a mistake>", "exec"), scope)
        return scope[fn.__name__]
    wrong = lambda *args, **kwargs: build()(*args, **kwargs)  # noqa: E731  (a function: it binds as a method)
    wrong.build = build
    return wrong


def region(name: str, hint: str, reference: Callable, fixed: Callable, mistakes: tuple = (), **kw: Any) -> None:
    """Declare the check of region `name` (see Region)."""
    wrong = tuple((what, v if callable(v) else edited(reference, *([v] if isinstance(v[0], str) else v)))
                  for what, v in mistakes)
    REGIONS[name] = Region(name, hint, reference, fixed, mistakes=wrong, **kw)


def with_method(cls: type, name: str, rule: Callable) -> type:
    """The chapter's class (its __init__ and helpers, given code) with `rule` as its method `name`."""
    return type(cls.__name__, (cls,), {name: rule, "__doc__": cls.__doc__})


def _impl(r: Region, yours: Any, rule: Callable) -> Any:
    return with_method(yours, r.method, rule) if r.method else rule


def fallback(r: Region, yours: Any) -> Any:
    return _impl(r, yours, r.reference)


def differs(what: str, yours: Any, want: Any, tol: Any, at: tuple = ()) -> tuple[str, tuple] | None:
    """(the first difference between yours and the library's `want` in words, its index) or None."""
    tol = tol.get(what, 1e-5) if isinstance(tol, Mapping) else tol
    if isinstance(want, Mapping):
        if not isinstance(yours, Mapping) or set(yours) != set(want):
            keys = sorted(yours, key=str) if isinstance(yours, Mapping) else type(yours).__name__
            return f"{what} has the keys {keys}; the library's {sorted(want, key=str)}", at
        return next(filter(None, (differs(f"{what}[{k!r}]", yours[k], want[k], tol, at) for k in want)), None)
    if torch.is_tensor(want):
        return _tensor_differs(what, yours, want, tol, at)
    if isinstance(want, (list, tuple)):
        yours = yours.tolist() if isinstance(yours, (torch.Tensor, np.ndarray)) else yours
        if not isinstance(yours, (list, tuple)):
            return f"{what} is a {type(yours).__name__}, not a {type(want).__name__}", at
        n = min(len(yours), len(want))
        found = next(filter(None, (differs(what, yours[i], want[i], tol, at + (i,)) for i in range(n))), None)
        if found or len(yours) == len(want):
            return found
        shown = [repr(s[n]) if len(s) > n else "nothing (it ends before)" for s in (yours, want)]
        return (f"{what} differs first at index {at + (n,)}: yours {shown[0]}, the library's {shown[1]} (yours has "
                f"{len(yours)} items, the library's {len(want)})"), at + (n,)
    yours = yours.item() if isinstance(yours, np.generic) or torch.is_tensor(yours) and yours.dim() == 0 else yours
    t = getattr(tol, "tight", tol)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (yours, want)):
        same = math.isclose(yours, want, rel_tol=t, abs_tol=t) or math.isnan(yours) and math.isnan(want)
    else:
        same = type(yours) is type(want) and yours == want
    where = f" differs first at index {at}:" if at else ":"
    return None if same else (f"{what}{where} yours {yours!r}, the library's {want!r}", at)


def _tensor_differs(what: str, yours: Any, want: torch.Tensor, tol: Any, at: tuple) -> tuple[str, tuple] | None:
    if not torch.is_tensor(yours) or yours.shape != want.shape or yours.dtype != want.dtype:
        kind = f"{yours.dtype} of shape {tuple(yours.shape)}" if torch.is_tensor(yours) else type(yours).__name__
        return f"{what} is {kind}; the library's is {want.dtype} of shape {tuple(want.shape)}", at
    tight, loose, share = (tol.tight, tol.loose, tol.share) if isinstance(tol, Share) else (tol, tol, 0.0)
    y, w = yours.detach().double().cpu(), want.detach().double().cpu()
    bad, off = (~torch.isclose(y, w, rtol=t, atol=t, equal_nan=True) for t in (loose, tight))
    if not bad.any() and off.double().mean() <= share:
        return None
    first = tuple(int(i) for i in (bad if bad.any() else off).nonzero()[0])
    count = f"{int(bad.sum())} of {bad.numel()} values differ" if bad.any() else (
        f"{int(off.sum())} of {off.numel()} values differ beyond float32 rounding, where float32 math cast at the end "
        "differs on a few at most")
    return f"{what} differs first at index {at + first}: yours {y[first]:.6g}, the library's {w[first]:.6g} " \
        f"({count})", at + first


class Raised:
    """An exception as an output: two versions that fail with the same message compare equal."""
    def __init__(self, error: Exception):
        self.error, self.key = error, (type(error).__name__, str(error))


def _outputs(r: Region, impl: Any, case: Case) -> dict | Raised:
    try:
        out = r.run(impl, case)
    except Exception as e:  # the code raised: a shape, a name, a type
        return Raised(e)
    return out if isinstance(out, dict) and r.output == "the result" else {r.output: out}


def _same(a: Any, b: Any, tol: Any) -> bool:
    if isinstance(a, Raised) or isinstance(b, Raised):
        return isinstance(a, Raised) and isinstance(b, Raised) and a.key == b.key
    tight = {k: getattr(t, "tight", t) for k, t in tol.items()} if isinstance(tol, Mapping) else getattr(tol, "tight",
                                                                                                        tol)
    return not any(differs(k, a.get(k), b[k], tight) for k in b)


def _code(r: Region, yours: Any) -> Any:
    fn = getattr(yours, r.method, None) if r.method else yours
    return None if fn is getattr(torch.nn.Module, r.method or "", None) else getattr(inspect.unwrap(fn), "__code__",
                                                                                     None)


def _is_stub(code: Any) -> bool:
    """Whether a function's code is nbgrader's stub alone: `raise NotImplementedError()` after the docstring."""
    ops = [i for i in dis.get_instructions(code) if i.opname not in ("RESUME", "NOP", "PRECALL", "PUSH_NULL", "CACHE")]
    names = [i.opname for i in ops]
    return names == ["LOAD_GLOBAL", "CALL", "RAISE_VARARGS"] and ops[0].argval == "NotImplementedError"


def _raised(r: Region, yours: Any, outcome: Raised) -> str:
    e, code, tb = outcome.error, _code(r, yours), outcome.error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if isinstance(e, NotImplementedError) and tb is not None and tb.tb_frame.f_code is code:
        return (f"your code runs into the stub's `raise NotImplementedError()` ({tb.tb_lineno - code.co_firstlineno} "
                f"lines below `def {code.co_name}`): delete that line once the code above it is written")
    return f"running it raised {type(e).__name__}: {e}"


def _verdict(r: Region, yours: Any, seed: int) -> tuple | None:
    """None when yours agrees with the reference on every case, else (case, difference, index, cause, drawn)."""
    fixed, drawn = r.fixed(), r.drawn(torch.Generator().manual_seed(seed))
    got = [_outputs(r, yours, c) for c in fixed]
    for i, case in enumerate(fixed + drawn):
        mine, tol = got[i] if i < len(fixed) else _outputs(r, yours, case), case.tol or r.tol
        want = _outputs(r, fallback(r, yours), case)
        if isinstance(want, Raised):
            raise RuntimeError(f"{r.name}: the library's version failed on {case.what}") from want.error
        found = (_raised(r, yours, mine), ()) if isinstance(mine, Raised) else next(
            filter(None, (differs(k, mine.get(k), want[k], tol) for k in want)), None)
        if found:
            cases, mine_all = (fixed, got) if i < len(fixed) else (fixed + [case], got + [mine])
            cause = next((what for what, wrong in r.mistakes if all(_same(
                m, _outputs(r, _impl(r, yours, wrong), c), c.tol or r.tol)
                for m, c in zip(mine_all, cases))), None)
            return case, found[0], found[1], cause, i >= len(fixed)
    return None


@contextlib.contextmanager
def _stand_ins(yours: Any) -> Any:
    """While yours is checked: the library's rule in place of every other region's failed object its code reads."""
    fns = [getattr(v, "__func__", v) for v in vars(yours).values()] if isinstance(yours, type) else [yours]
    fns = [inspect.unwrap(f) if callable(f) else f for f in fns]
    codes, names = [f.__code__ for f in fns if hasattr(f, "__code__")], set()
    g = next((f.__globals__ for f in fns if hasattr(f, "__globals__")), {})
    while codes:
        names |= set(codes[-1].co_names)
        codes += [c for c in codes.pop().co_consts if hasattr(c, "co_names")]
    notes, swapped = [], {}
    for name in sorted(n for n in names if n in g and g[n] is not yours):
        with contextlib.suppress(KeyError, TypeError):
            notes.append((name, HISTORY[g[name]][1]))
            if notes[-1][1] == "failed":
                swapped[name], g[name] = g[name], fallback(REGIONS[HISTORY[g[name]][0]], g[name])
    try:
        yield notes
    finally:
        g.update(swapped)


def _whose(notes: list, passed: bool) -> str:
    """Whose code the check ran: the other regions' objects it used (after a pass, only when some were not yours)."""
    names = {v: ", ".join(n for n, verdict in notes if verdict == v) for v in ("passed", "library", "failed")}
    said = [f"your {names['passed']} (passed)"] if names["passed"] and not passed else []
    said += [f"the library's {names['library']} (yours is not written yet)"] if names["library"] else []
    said += [f"the library's rule in place of your {names['failed']}, which has not passed its check"] \
        if names["failed"] else []
    after = f" The notebook goes on with yours, which uses your {names['failed']}: fix it, run its check again." \
        if passed and names["failed"] else ""
    return f" Whose code: checked with {'; '.join(said)}.{after}" if said else ""


def not_right(message: str, cause: str | None = None) -> NotRightYet:
    error = NotRightYet(message)
    error.cause = cause  # the usual mistake named, or None
    return error


def check(name: str, yours: Any) -> Any:
    """Check what region `name` defined; return what the notebook uses from here on (see the module's doc)."""
    r = REGIONS[name]
    if not callable(yours):
        raise not_right(f"{name}: not right yet: it is a {type(yours).__name__}, not a "
                        f"{('function', 'class')[bool(r.method)]}. Hint: {r.hint}")
    code = _code(r, yours)
    if code is None:
        near = difflib.get_close_matches(r.method, [k for k, v in vars(yours).items() if callable(v)], 1)
        raise not_right(f"{name}: not right yet: your class {yours.__name__} has no method `{r.method}`"
                        f"{f' (it has `{near[0]}`: a misspelling?)' if near else ''}. Hint: {r.hint}")
    if _is_stub(code):
        print(f"{name}: {NOT_WRITTEN}. Hint: {r.hint} Until it is, the notebook goes on with minimind_lib's version.")
        stand_in = fallback(r, yours)
        HISTORY[stand_in] = (name, "library")
        return stand_in
    seed = int.from_bytes(os.urandom(4), "little")
    with _stand_ins(yours) as notes, torch.no_grad(), r.around():
        found = _verdict(r, yours, seed)
    HISTORY[yours] = (name, "failed" if found else "passed")
    if found is None:
        print(f"{name}: {PASSED} (equal to minimind_lib's on fresh random inputs); the notebook uses yours from here "
              f"on.{_whose(notes, True)}")
        return yours
    case, difference, at, cause, drawn = found
    where = f" {r.reading(case, at)}" if r.reading and at and not cause else ""
    axes = f" ({', '.join(f'{a} {i}' for a, i in zip(r.axes, at))})" if r.axes and len(at) == len(r.axes) else ""
    raise not_right(f"{name}: not right yet: on {case.what}, {difference}{axes}.{where}"
                    + (f" It gives exactly what this usual mistake gives: {cause}" if cause else "")
                    + _whose(notes, False)
                    + (f" (A random case, seed {seed}.)" if drawn else "") + f" Hint: {r.hint}", cause) from None


def draw(g: torch.Generator, low: int, high: int) -> int:
    """An integer from low to high, both included."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


def pick(g: torch.Generator, options: tuple) -> Any:
    return options[draw(g, 0, len(options) - 1)]


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn from `seed`, norm gains away from 1 (a forgotten or misplaced gain shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if "norm" in name else torch.randn(p.shape, generator=g) / 5)
    return module.eval()


for _table in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("ch")):
    importlib.import_module(f"{__name__}.{_table}")
from .ch09_beyond_one_gpu import per_rank_memory  # noqa: E402,F401  (09's reference: no library function has it)
