"""08_sft's regions, against minimind_lib.generate: KV-cache generation, top-p (the mask: 02's)."""
import copy
from unittest import mock
import torch
from minimind_lib import generate as G
from . import Case, draw, edited, region
from .ch07_pretrain import scorer

def generate(*edits):  # my_generate from generate_ids, edited; `pick` (greedy by default) picks
    def my_generate(model, prompt_ids, n, pick=lambda logits: logits.argmax(-1), stop_ids=(),
                    use_cache=True):
        generate_ids = edited(G.generate_ids, *edits, sample_next=lambda logits, *_: pick(logits))
        return generate_ids(model, torch.tensor(prompt_ids), n, 0.0, use_cache=use_cache,
                            stop_token_ids=stop_ids)[0].tolist()
    return my_generate
def generated(fn, case):  # new tokens; positions per forward call
    model, seen = copy.deepcopy(scorer(0)), []
    model.register_forward_pre_hook(lambda m, args, kw: seen.append(
        (args[0] if args else kw["input_ids"]).shape[1]), with_kwargs=True)
    new = fn(model, *case.args[:2], lambda logits: logits.argmax(-1), *case.args[2:])
    return {"the new tokens": list(map(int, new)), "the positions each forward call ran": seen}
def greedy(prompt, n, stop_at=None, caches=(True, False)):
    free = generate()(scorer(0), prompt, n)
    stops = [] if stop_at is None else [free[stop_at]]
    return [Case(f"the greedy tokens after the prompt {prompt} of a random model (max_new_tokens="
                 f"{n}, stop_ids={stops}, use_cache={c})", prompt, n, stops, c) for c in caches]
region("my_generate", "the prompt once, then each picked token alone with the cache, up to a stop.",
       generate(), run=generated,
       fixed=lambda: greedy([1, 5, 9, 4], 6) + greedy([1, 5, 9, 4], 6, 2)
       + greedy([7], 1, None, [True]) + greedy([3, 3], 5, 0, [True]),
       drawn=lambda g: greedy([draw(g, 0, 6399) for _ in range(draw(g, 1, 10))], draw(g, 2, 12)),
       mistakes=(("With use_cache=True it runs the whole sequence again: feed the new token.",
                  generate(("if use_cache:", "if False:"))),
                 ("It makes one token more than max_new_tokens.",
                  generate(("range(max_new_tokens)", "range(max_new_tokens + 1)")))))
def nucleus(*edits):  # keep_top_p from sample_next, edited; -inf: dropped
    sample_next = edited(G.sample_next, *edits)
    def keep_top_p(logits, top_p):
        seen, draw = [], lambda p, n, generator: seen.append(p) or torch.zeros(len(p), 1, dtype=int)
        with mock.patch.object(torch, "multinomial", draw):
            sample_next(logits.float(), 1.0, top_p)
        return logits.float().masked_fill(~(seen[0] > 0), float("-inf"))  # NaN: all dropped
    return keep_top_p
region("keep_top_p", "sorted, a token goes once those before it hold top_p; in vocabulary order.",
       nucleus(), tol=1e-6, axes=("row", "token"),
       run=lambda fn, c: fn(c.args[0].clone(), c.args[1]).float().softmax(-1),
       output="the probabilities to sample from (the softmax of what it returns)",
       fixed=lambda: [(torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]), 0.8),
                      (torch.tensor([[0.1, 2.0, -1.0], [3.0, -2.0, 0.2]]), 0.5),
                      (torch.tensor([[1.0, 5.0, 2.0, 0.0]]), 0.05)],
       drawn=lambda g: [(torch.randn(draw(g, 1, 4), draw(g, 5, 300), generator=g) * 2,
                         draw(g, 5, 95) / 100) for _ in range(3)],
       mistakes=(("It keeps the wrong side, the unlikely tail.", nucleus((">= top_p", "< top_p"))),
                 ("It drops the token that carries the sum past p: keep it.",
                  nucleus(("cum - sorted_logits.softmax(-1) >=", "cum >"))),
                 ("Its softmax runs over the batch (dim 0), not the vocabulary.",
                  nucleus(("sorted_logits.softmax(-1)", "sorted_logits.softmax(0)")))))
