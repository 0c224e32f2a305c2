"""The lab edition's checks: this engine, and a table of regions per chapter (chNN_*.py beside it).
`X = lab.check(name, X)` after a region: a stub gets "not written yet"; written code runs on the
region's fixed cases (they decide), then random ones, against the library. The first difference is
told in the learner's terms; a usual mistake named only when running it gives exactly yours."""
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
from types import SimpleNamespace
import numpy as np
import torch
from exercise_checks import NotRightYet

REGIONS, HISTORY = {}, {}  # name -> its check; an object checked -> (its region, its verdict)
class Case:
    """One input of a check: what it is in the learner's words, the arguments, its own tolerance."""
    def __init__(self, what, *args, tol=None):
        self.what, self.args, self.tol = what, args, tol
def edited(fn, *pairs, **names):
    """`fn` with each (old, new) replaced in its source, and `names` in its globals: a mistake."""
    @functools.cache
    def build():
        source = textwrap.dedent(inspect.getsource(fn))
        for old, new in pairs:
            if old not in source:
                raise LookupError(f"{old!r} is not in the source of {fn.__qualname__}")
            source = source.replace(old, new)
        scope = {**inspect.unwrap(fn).__globals__, **names}
        exec(compile(source, f"<{fn.__qualname__}, edited>", "exec"), scope)
        return scope[fn.__name__]
    wrong = lambda *args, **kw: build()(*args, **kw)  # noqa: E731  (a function: binds as a method)
    wrong.build = build
    return wrong
def region(name, hint, reference, fixed, mistakes=(), **kw):
    """Declare region `name`'s check (as tools/handout.py names it). hint: where to look; reference:
    the library's rule; fixed: cases always run (or a function giving them), a Case or a tuple of
    arguments each; mistakes: (what it does and what to change, the wrong version: a function, an
    (old, new) edit of the reference's source, or a list of edits). Optional: drawn (Generator ->
    cases), run ((implementation, case) -> output or {name: output}), tol (a number, (tight, loose,
    share beyond tight) or {output: tol}), method (run gets a class), output (its name), axes (a
    tensor output's), reading ((case, index) -> what it usually means), around (a context)."""
    wrong = [(m[0], m[1] if callable(m[1]) else edited(reference, *(
        [m[1:]] if isinstance(m[1], str) else m[1]))) for m in mistakes]
    REGIONS[name] = SimpleNamespace(**{
        "drawn": lambda g: [], "run": lambda fn, case: fn(*copy.deepcopy(case.args)), "tol": 1e-5,
        "method": None, "output": "the result", "axes": (), "reading": None,
        "around": contextlib.nullcontext, **kw}, name=name, hint=hint, reference=reference,
        fixed=fixed, mistakes=wrong)
def _cases(r, cases):  # Case each; a tuple of arguments is named by the call
    def shown(v):
        if torch.is_tensor(v) and v.numel() >= 20:
            return f"a tensor of shape {tuple(v.shape)}"
        return repr(v.tolist() if torch.is_tensor(v) else v)
    return [c if isinstance(c, Case) else Case(f"{r.name}({', '.join(map(shown, c))})", *c)
            for c in (cases() if callable(cases) else cases)]
def _impl(r, yours, rule):  # rule, or for a method region the learner's class with it
    return type(yours.__name__, (yours,), {r.method: rule}) if r.method else rule
def differs(what, yours, want, tol, at=()):  # (the first difference in words, its index) or None
    tol = tol.get(what, 1e-5) if isinstance(tol, dict) else tol
    first = lambda found: next(filter(None, found), None)  # noqa: E731
    if isinstance(want, dict):
        if not isinstance(yours, dict) or set(yours) != set(want):
            keys = sorted(yours, key=str) if isinstance(yours, dict) else type(yours).__name__
            return f"{what} has the keys {keys}; the library's {sorted(want, key=str)}", at
        return first(differs(f"{what}[{k!r}]", yours[k], want[k], tol, at) for k in want)
    if torch.is_tensor(want):
        return _tensor_differs(what, yours, want, tol, at)
    if isinstance(want, (list, tuple)):
        yours = yours.tolist() if isinstance(yours, (torch.Tensor, np.ndarray)) else yours
        if not isinstance(yours, (list, tuple)):
            return f"{what} is a {type(yours).__name__}, not a {type(want).__name__}", at
        n = min(len(yours), len(want))
        found = first(differs(what, yours[i], want[i], tol, at + (i,)) for i in range(n))
        if found or len(yours) == len(want):
            return found
        return (f"{what} differs first at index {at + (n,)}: yours has {len(yours)} items, the "
                f"library's {len(want)}"), at + (n,)
    if isinstance(yours, np.generic) or torch.is_tensor(yours) and yours.dim() == 0:
        yours = yours.item()
    t = tol[0] if isinstance(tol, tuple) else tol
    same = type(yours) is type(want) and yours == want
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (yours, want)):
        nan = math.isnan(yours) and math.isnan(want)
        same = nan or math.isclose(yours, want, rel_tol=t, abs_tol=t)
    where = f" differs first at index {at}:" if at else ":"
    return None if same else (f"{what}{where} yours {yours!r}, the library's {want!r}", at)
def _tensor_differs(what, yours, want, tol, at):
    kind = f"{yours.dtype} of shape {tuple(yours.shape)}" if torch.is_tensor(yours) else type(
        yours).__name__
    if kind != f"{want.dtype} of shape {tuple(want.shape)}":
        return f"{what} is {kind}; the library's is {want.dtype} of shape {tuple(want.shape)}", at
    tight, loose, share = tol if isinstance(tol, tuple) else (tol, tol, 0.0)
    y, w = yours.detach().double().cpu(), want.detach().double().cpu()
    bad, off = (~torch.isclose(y, w, rtol=t, atol=t, equal_nan=True) for t in (loose, tight))
    if not bad.any() and off.double().mean() <= share:
        return None
    first = tuple(int(i) for i in (bad if bad.any() else off).nonzero()[0])
    count = f"{int(bad.sum())} of {bad.numel()} values differ" if bad.any() else (
        f"{int(off.sum())} of {off.numel()} values differ beyond float32 rounding, where float32 "
        "math cast at the end differs on a few at most")
    return (f"{what} differs first at index {at + first}: yours {y[first]:.6g}, the library's "
            f"{w[first]:.6g} ({count})"), at + first
def _outputs(r, impl, case):  # {output name: value}, or the exception raised
    try:
        out = r.run(impl, case)
    except Exception as e:  # the code raised: a shape, a name, a type
        return e
    return out if isinstance(out, dict) and r.output == "the result" else {r.output: out}
def _same(a, b, tol):  # equal to the tight tolerance (exceptions: same message)
    if isinstance(a, Exception) or isinstance(b, Exception):
        return repr(a) == repr(b)
    tight = tol[0] if isinstance(tol, tuple) else tol
    return not any(differs(k, a.get(k), b[k], tight) for k in b)
def _code(r, yours):
    fn = getattr(yours, r.method, None) if r.method else yours
    if fn is getattr(torch.nn.Module, r.method or "", None):
        return None  # nn.Module's own forward: the class has none
    return getattr(inspect.unwrap(fn), "__code__", None)
def _is_stub(code):  # nbgrader's stub alone: raise NotImplementedError()
    skip = ("RESUME", "NOP", "PRECALL", "PUSH_NULL", "CACHE")
    ops = [i for i in dis.get_instructions(code) if i.opname not in skip]
    return [i.opname for i in ops] == ["LOAD_GLOBAL", "CALL", "RAISE_VARARGS"] and \
        ops[0].argval == "NotImplementedError"
def _raised(r, yours, e):
    code, tb = _code(r, yours), e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if isinstance(e, NotImplementedError) and tb is not None and tb.tb_frame.f_code is code:
        return (f"your code runs into the stub's `raise NotImplementedError()`, line "
                f"{tb.tb_lineno - code.co_firstlineno} below `def {code.co_name}`: delete it")
    return f"running it raised {type(e).__name__}: {e}"
def _verdict(r, yours, seed):  # None, or (case, difference, index, cause, drawn)
    fixed, drawn = _cases(r, r.fixed), _cases(r, r.drawn(torch.Generator().manual_seed(seed)))
    got = [_outputs(r, yours, c) for c in fixed]
    for i, case in enumerate(fixed + drawn):
        mine, tol = got[i] if i < len(fixed) else _outputs(r, yours, case), case.tol or r.tol
        want = _outputs(r, _impl(r, yours, r.reference), case)
        if isinstance(want, Exception):
            raise RuntimeError(f"{r.name}: the library failed on {case.what}") from want
        found = (_raised(r, yours, mine), ()) if isinstance(mine, Exception) else next(
            filter(None, (differs(k, mine.get(k), want[k], tol) for k in want)), None)
        if found:
            cases, mine_all = (fixed, got) if i < len(fixed) else (fixed + [case], got + [mine])
            cause = next((what for what, wrong in r.mistakes if all(
                _same(m, _outputs(r, _impl(r, yours, wrong), c), c.tol or r.tol)
                for m, c in zip(mine_all, cases))), None)
            return case, found[0], found[1], cause, i >= len(fixed)
    return None
@contextlib.contextmanager
def _stand_ins(yours):
    """While yours is checked: the library's rule in place of every other region's failed object
    that its code reads; yields [(name, verdict)] of the checked objects it reads."""
    fns = list(vars(yours).values()) if isinstance(yours, type) else [yours]
    fns = [inspect.unwrap(getattr(f, "__func__", f)) for f in fns if callable(f)]
    codes, names = [f.__code__ for f in fns if hasattr(f, "__code__")], set()
    g = next((f.__globals__ for f in fns if hasattr(f, "__globals__")), {})
    while codes:
        names |= set(codes[-1].co_names)
        codes += [c for c in codes.pop().co_consts if hasattr(c, "co_names")]
    notes, swapped = [], {}
    for name in sorted(n for n in names if n in g and g[n] is not yours):
        with contextlib.suppress(KeyError, TypeError):  # not checked, or not hashable
            other, verdict = HISTORY[g[name]]
            notes.append((name, verdict))
            if verdict == "failed":
                swapped[name] = g[name]
                g[name] = _impl(REGIONS[other], g[name], REGIONS[other].reference)
    try:
        yield notes
    finally:
        g.update(swapped)
def _whose(notes, passed):  # the other regions' objects the check used
    said = {"passed": "your {} (passed)", "library": "the library's {} (yours is not written yet)",
            "failed": "the library's rule in place of your {}, which has not passed its check"}
    names = {v: ", ".join(n for n, verdict in notes if verdict == v) for v in said}
    said = [said[v].format(names[v]) for v in said if names[v] and not (passed and v == "passed")]
    after = f" The notebook goes on with yours, which uses your {names['failed']}: fix it, run " \
        "its check again." if passed and names["failed"] else ""
    return f" Whose code: checked with {'; '.join(said)}.{after}" if said else ""
def check(name, yours):
    """Check what region `name` defined; return what the notebook uses from here on."""
    r = REGIONS[name]
    code = _code(r, yours) if callable(yours) else None
    if code is None:
        what = f"it is a {type(yours).__name__}, not a {'class' if r.method else 'function'}"
        if isinstance(yours, type) and r.method:
            near = difflib.get_close_matches(r.method, [k for k in vars(yours) if k[0] != "_"], 1)
            what = f"your class {yours.__name__} has no method `{r.method}`" + (
                f" (it has `{near[0]}`: a misspelling?)" if near else "")
        raise NotRightYet(f"{name}: not right yet: {what}. Hint: {r.hint}")
    if _is_stub(code):
        print(f"{name}: not written yet. Hint: {r.hint} Until it is, the notebook goes on with "
              "minimind_lib's version.")
        stand_in = _impl(r, yours, r.reference)
        HISTORY[stand_in] = (name, "library")
        return stand_in
    seed = int.from_bytes(os.urandom(4), "little")
    with _stand_ins(yours) as notes, torch.no_grad(), r.around():
        found = _verdict(r, yours, seed)
    HISTORY[yours] = (name, "failed" if found else "passed")
    if found is None:
        print(f"{name}: passed (equal to minimind_lib's on fresh random inputs); the notebook "
              f"uses yours from here on.{_whose(notes, True)}")
        return yours
    case, difference, at, cause, drawn = found
    if r.axes and len(at) == len(r.axes):
        difference += f" ({', '.join(f'{a} {i}' for a, i in zip(r.axes, at))})"
    where = f" {r.reading(case, at)}" if r.reading and at else ""
    said = f" It gives exactly what this usual mistake gives: {cause}" if cause else where
    seeded = f" (A random case, seed {seed}.)" if drawn else ""
    error = NotRightYet(f"{name}: not right yet: on {case.what}, {difference}.{said}"
                        f"{_whose(notes, False)}{seeded} Hint: {r.hint}")
    error.cause = cause  # the usual mistake named, or None
    raise error from None
def draw(g, low, high):  # an integer from low to high, both included.
    return int(torch.randint(low, high + 1, (1,), generator=g))
def pick(g, options):
    return options[draw(g, 0, len(options) - 1)]
def randomized(module, seed):  # parameters drawn from seed, norm gains away from 1
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if "norm" in name
                    else torch.randn(p.shape, generator=g) / 5)
    return module.eval()
for _table in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("ch")):
    importlib.import_module(f"{__name__}.{_table}")
from .ch09_beyond_one_gpu import per_rank_memory  # noqa: E402,F401  (09's reference, for tests)
