"""05_mixed_precision's region, against torch.amp.GradScaler: the update of the dynamic loss scale."""
import math

import torch

from . import Case, draw, pick, region


def update(self):
    """torch.amp.GradScaler's update rule (its _amp_update_scale_) as the chapter's HandScaler.update."""
    if self.found_inf:
        self.scale_value *= self.backoff_factor
        self.good_steps = 0
    else:
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale_value *= self.growth_factor
            self.good_steps = 0
    self.unscaled = False


def _trace(cls, case):
    """The scale after each step of a run whose step i overflows when overflows[i]."""
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer, scaler, trace = torch.optim.SGD([p], lr=0.0), cls(**case.args[0]), []
    for bad in case.args[1]:
        scaler.scale(torch.ones(()))
        p.grad = torch.tensor([1.0, math.inf if bad else 1.0, 1.0])
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        trace.append(float(scaler.get_scale()))
    return torch.tensor(trace, dtype=torch.float64)


def _run(kw, overflows):
    return Case(f"{len(overflows)} steps ({', '.join(f'{k}={v:g}' for k, v in kw.items())}) overflowing at steps "
                f"{[i for i, bad in enumerate(overflows) if bad]}", kw, overflows)


def _drawn(g):
    kw = {"init_scale": 2.0 ** draw(g, 4, 16), "growth_factor": pick(g, (2.0, 4.0)),
          "backoff_factor": pick(g, (0.5, 0.25)), "growth_interval": draw(g, 2, 5)}
    return [_run(kw, (torch.rand(draw(g, 10, 25), generator=g) < pick(g, (0.15, 0.4))).tolist())]


GROW = "if self.good_steps == self.growth_interval:"
region("HandScaler.update", "after an overflow (found_inf): the scale times backoff_factor, the count of good steps "
       "from 0 again; after a good step: count it, and when the count reaches growth_interval, the scale times "
       "growth_factor and the count from 0 again.", update, method="update", run=_trace,
       output="the scale after each step", axes=("step",), tol=0.0, drawn=_drawn,
       fixed=lambda: [_run({"init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3},
                           [i in (2, 10) for i in range(14)])],
       mistakes=(("After an overflow it goes on counting the good steps from before it: an overflow starts the count "
                  "from 0 again, so the scale grows only after growth_interval good steps in a row.",
                  ("self.good_steps = 0\n    else", "pass\n    else")),
                 ("It grows the scale after every good step: only after growth_interval good steps in a row.",
                  (GROW, "if True:")),
                 ("It grows the scale one good step late: the step that brings the count to growth_interval grows it.",
                  (GROW, "if self.good_steps > self.growth_interval:")),
                 ("After growing it does not start the count again, so it grows at every good step from then on.",
                  [(GROW, "if self.good_steps >= self.growth_interval:"),
                   ("self.scale_value *= self.growth_factor\n            self.good_steps = 0",
                    "self.scale_value *= self.growth_factor")]),
                 ("On an overflow it leaves the scale as it is: it must shrink (times backoff_factor), or the next "
                  "step overflows again.", ("self.scale_value *= self.backoff_factor", "pass"))))
