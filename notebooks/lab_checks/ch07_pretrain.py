"""07_pretrain's regions, against minimind_lib.evaluate: the verdict against the band, bits per byte."""
import functools
import math
import re
from unittest import mock

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from minimind_lib import evaluate as ev
from minimind_lib.model import MiniMindForCausalLM

from . import Case, draw, edited, randomized, region
from .ch02_data import tok, words
from .ch03_model import config


def library_verdict(val: pd.DataFrame, ref: dict) -> tuple:
    """minimind_lib's judge (evaluate.judge) on these points and this band: (inside|above|below, N or None)."""
    band = {"profile": "random", "n_seeds": 5, "seeds": [1, 2, 3, 4, 5], "method": "",
            "made_by": dict.fromkeys(("device", "cpu", "threads", "torch", "date"), "?")}
    with mock.patch.object(ev, "load_band", lambda cfg: (band, {"dtype": "fp32", "training": {}, **ref})), \
            mock.patch.object(ev, "doctor", lambda *args: []):  # divergence is the doctor's, not this region's
        out = ev.judge(pd.DataFrame(val), {"stage": "pretrain", "train": {}})
    since = re.search(r" from ([\d,]+) tokens on", out["summary"])
    return out["verdict"], int(since.group(1).replace(",", "")) if since else None


def verdict(val, ref):
    """The chapter's verdict (the base of the usual mistakes)."""
    tokens = np.asarray(ref["tokens"])
    val = val[val["tokens_seen"] <= 1.1 * tokens[-1]]
    x, loss = val["tokens_seen"].to_numpy(), val["val_loss"].to_numpy()
    side = (loss > np.interp(x, tokens, ref["upper"])).astype(int) - (loss < np.interp(x, tokens, ref["lower"]))
    if side[-1] == 0:
        return "inside", None
    first = len(side) - 1
    while first > 0 and side[first - 1] == side[-1]:
        first -= 1
    return ("above" if side[-1] > 0 else "below"), int(x[first])


def _points(tokens, losses, ref=None):
    ref = ref or {"tokens": [0.0, 1000.0], "lower": [8.0, 5.0], "upper": [9.0, 6.0], "quantiles": {"0.5": [8.5, 5.5]}}
    return Case(f"the points (tokens_seen, val_loss) {list(zip(tokens, losses))} against a band ending at "
                f"{ref['tokens'][-1]:.0f} tokens", pd.DataFrame({"step": range(len(tokens)), "tokens_seen": tokens,
                                                                 "val_loss": losses}), ref)


def _random_run(g):
    n = draw(g, 3, 12)
    tokens = np.cumsum(np.r_[0.0, torch.rand(n - 1, generator=g).double().numpy() + 0.2]).round(3) * 1000
    median, half = 8.8 - 3 * np.linspace(0, 1, n) ** 0.5, torch.rand(n, generator=g).double().numpy() * 0.3 + 0.05
    ref = {"tokens": tokens.tolist(), "lower": (median - half).tolist(), "upper": (median + half).tolist(),
           "quantiles": {"0.5": median.tolist()}}
    x = np.sort(np.r_[0.0, torch.rand(draw(g, 0, 9), generator=g).double().numpy() * 1.3 * tokens[-1]]).round(1)
    sides = np.cumsum(torch.rand(len(x), generator=g).numpy() < 0.35) % 3 - 1  # runs of points on one side
    width = np.interp(x, tokens, half)
    return _points(x.tolist(), (np.interp(x, tokens, median) + np.where(sides == 0, 0.5 * width, sides * (
        width + 0.05))).round(3).tolist(), ref)


region("my_verdict", "read the band's lower and upper at each point's tokens (np.interp), keep the points up to 1.1 x "
       "the band's last token count, mark each above, below or inside; the last point decides, and N is where the "
       "last unbroken run of points on its side began.", library_verdict,
       run=lambda fn, c: list(fn(c.args[0].copy(), c.args[1])), output="(verdict, N)",
       fixed=lambda: [_points([0.0, 500.0, 2000.0], [8.5, 7.0, 9.0]), _points([0.0, 400.0, 800.0], [9.5, 6.0, 6.3]),
                      _points([0.0, 200.0, 400.0, 600.0, 800.0], [8.5, 9.0, 7.0, 7.0, 6.5])],
       drawn=lambda g: [_random_run(g) for _ in range(6)],
       mistakes=(("It judges a point past 1.1 x the band's last token count: the band says nothing there.",
                  edited(verdict, ('val = val[val["tokens_seen"] <= 1.1 * tokens[-1]]', "pass"))),
                 ("The first point decides; the last point does (where the run ended).",
                  edited(verdict, ("side[-1]", "side[0]"), ("first = len(side) - 1", "first = 0"))),
                 ("N is the first point on the last point's side at all: it is where the last unbroken run began.",
                  edited(verdict, ("first = len(side) - 1", "first = int(np.flatnonzero(side == side[-1])[0])")))))


@functools.cache
def scorer(seed: int) -> torch.nn.Module:
    """A small random model over the course's 6400 tokens."""
    return randomized(MiniMindForCausalLM(config(seed, heads=2, kv=1, head_dim=8, hidden=16, vocab=6400)), seed)


def library_bits_per_byte(model, texts):
    """minimind_lib's bits per byte (evaluate.text_ladder's, unrounded): every token of every text scored from [bos]
    and the tokens before it (evaluate.token_scores), in bits, over the texts' UTF-8 bytes."""
    nats = sum(float(nll.astype(np.float64).sum()) for nll, *_ in ev.token_scores(
        model, [np.array([tok().bos_token_id, *tok().encode(t)]) for t in texts]))
    return nats / (math.log(2) * sum(len(t.encode("utf-8")) for t in texts))


def bits(model, texts):
    """The chapter's bits per byte (the base of the usual mistakes)."""
    nats = 0.0
    for text in texts:
        x = torch.tensor([[tok().bos_token_id, *tok().encode(text)]])
        nats += float(F.cross_entropy(model(x).logits[0, :-1].float(), x[0, 1:], reduction="sum"))
    return nats / (math.log(2) * sum(len(t.encode("utf-8")) for t in texts))


region("bits_per_byte", "for each text, the model on [bos] and the text's ids: the logits at each position score the "
       "next token; add up the cross-entropies of every token of every text, the first given [bos]; then the total in "
       "bits (one bit is ln 2 nats) over the texts' UTF-8 bytes.", library_bits_per_byte,
       run=lambda fn, c: float(fn(scorer(c.args[0]), list(c.args[1]))), output="the bits per byte",
       fixed=lambda: [Case("the texts ['To be, or not to be.', '床前明月光，疑是地上霜。'] on a random model", 0,
                           ["To be, or not to be.", "床前明月光，疑是地上霜。"])],
       drawn=lambda g: [Case(f"the texts {t} on a random model", 1, t) for t in [[words(g, 1, 20) for _ in range(3)]]],
       mistakes=(("It adds up each text's mean loss per token: bits per byte needs the total, the sum over the tokens.",
                  edited(bits, ('reduction="sum"', 'reduction="mean"'))),
                 ("It leaves out each text's first token (scored from [bos] alone): run [bos] followed by the ids.",
                  edited(bits, ("[[tok().bos_token_id, *tok().encode(text)]]", "[tok().encode(text)]"))),
                 ("It divides by the characters; a Chinese character is 3 bytes in UTF-8: count the bytes.",
                  edited(bits, ('len(t.encode("utf-8"))', "len(t)"))),
                 ("It leaves the loss in nats: one bit is ln 2 nats.", edited(bits, ("math.log(2) * ", "")))))
