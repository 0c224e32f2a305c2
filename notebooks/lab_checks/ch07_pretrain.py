"""07_pretrain's regions, against minimind_lib.evaluate: the verdict on a band, bits per byte."""
import functools
import math
import re
import numpy as np
import pandas as pd
from minimind_lib import evaluate as ev
from minimind_lib.model import MiniMindForCausalLM
from . import Case, draw, edited, randomized, region
from .ch02_data import tok, words
from .ch03_model import config

BAND = {"profile": "random", "n_seeds": 5, "seeds": [1, 2, 3, 4, 5], "method": "",
        "made_by": dict.fromkeys(("device", "cpu", "threads", "torch", "date"), "?")}
ALONE = {"load_band": lambda cfg: (BAND, {"dtype": "fp32", "training": {}, **cfg["ref"]}),
         "doctor": lambda *args: []}  # the band given; divergence is the doctor's
def verdict(*edits):  # evaluate.judge, edited: (verdict, N or None)
    judge = edited(ev.judge, *edits, **ALONE)
    def my_verdict(val, ref):
        out = judge(pd.DataFrame(val), {"stage": "pretrain", "train": {}, "ref": ref})
        since = re.search(r" from ([\d,]+) tokens on", out["summary"])
        return out["verdict"], int(since.group(1).replace(",", "")) if since else None
    return my_verdict
def points(tokens, losses, end=1000.0):
    ref = {"tokens": [0.0, end], "lower": [8.0, 5.0], "upper": [9.0, 6.0],
           "quantiles": {"0.5": [8.5, 5.5]}}
    val = pd.DataFrame({"step": range(len(tokens)), "tokens_seen": tokens, "val_loss": losses})
    return Case(f"the points (tokens_seen, val_loss) {list(zip(tokens, losses))} against a band "
                f"from 8-9 at 0 tokens to 5-6 at {end:g}", val, ref)
region("my_verdict", "mark points up to 1.1 x the band's end; the last decides, N starts its run.",
       verdict(), run=lambda fn, c: list(fn(c.args[0].copy(), c.args[1])), output="(verdict, N)",
       fixed=lambda: [points([0.0, 500.0, 2000.0], [8.5, 7.0, 9.0]),
                      points([0.0, 400.0, 800.0], [9.5, 6.0, 6.3]),
                      points([0.0, 200.0, 400.0, 600.0, 800.0], [8.5, 9.0, 7.0, 7.0, 6.5]),
                      points([0.0, 200.0, 400.0, 600.0], [9.5, 8.0, 8.5, 8.0])],
       drawn=lambda g: [points(x, [draw(g, 40, 100) / 10 for _ in x], draw(g, 500, 1500))
                        for x in [sorted({0.0, *(float(draw(g, 1, 1500)) for _ in range(8))})]],
       mistakes=(("It judges points past 1.1 x the band's last token count: leave them out.",
                  verdict(('val = val[val["tokens_seen"] <= 1.1 * tokens[-1]]', "pass"))),))
@functools.cache
def scorer(seed):  # a small random model over the course's 6400 tokens
    return randomized(MiniMindForCausalLM(config(seed, 2, 1, 8, 16, vocab=6400)), seed)
def bits_per_byte(model, texts):  # text_ladder's, unrounded: every token from [bos] on
    rows = [np.array([tok().bos_token_id, *tok().encode(t)]) for t in texts]
    nats = sum(float(nll.astype(np.float64).sum()) for nll, *_ in ev.token_scores(model, rows))
    return nats / (math.log(2) * sum(len(t.encode("utf-8")) for t in texts))
region("bits_per_byte", "the cross-entropy of every token, the first after [bos], bits per byte.",
       bits_per_byte, run=lambda fn, c: float(fn(scorer(c.args[0]), list(c.args[1]))),
       fixed=[Case("the texts ['To be, or not to be.', '床前明月光，疑是地上霜。'] on a random model", 0,
                   ["To be, or not to be.", "床前明月光，疑是地上霜。"])],
       drawn=lambda g: [Case(f"the texts {t} on a random model", 1, t)
                        for t in [[words(g, 1, 20) for _ in range(3)]]],
       mistakes=(("It adds up each text's mean loss per token: add every token's.", ".sum()) for",
                  ".mean()) for"),
                 ("It leaves out each text's first token: score it from [bos].",
                  "tok().bos_token_id,", ""),
                 ("It divides by the characters: count UTF-8 bytes (3 for a Chinese one).",
                  'len(t.encode("utf-8"))', "len(t)")))
