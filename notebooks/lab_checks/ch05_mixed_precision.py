"""05_mixed_precision's region, against torch.amp.GradScaler: the dynamic loss scale's update."""
import math
import torch
from . import Case, draw, pick, region

def update(self):  # torch.amp.GradScaler's rule (its _amp_update_scale_) as HandScaler.update
    if self.found_inf:
        self.scale_value, self.good_steps = self.scale_value * self.backoff_factor, 0
    else:
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale_value, self.good_steps = self.scale_value * self.growth_factor, 0
    self.unscaled = False
def scales(cls, case):  # the scale after each step; step i overflows if overflows[i]
    p, out = torch.nn.Parameter(torch.zeros(2)), []
    optimizer, scaler = torch.optim.SGD([p], lr=0.0), cls(**case.args[0])
    for bad in case.args[1]:
        scaler.scale(torch.ones(()))
        p.grad = torch.tensor([1.0, math.inf if bad else 1.0])
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        out.append(float(scaler.get_scale()))
    return torch.tensor(out, dtype=torch.float64)
def run(growth_interval, overflows, init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5):
    kw = {k: v for k, v in locals().items() if k != "overflows"}  # GradScaler's arguments
    return Case(f"{len(overflows)} steps ({', '.join(f'{k}={v:g}' for k, v in kw.items())}) "
                f"overflowing at steps {[i for i, bad in enumerate(overflows) if bad]}", kw,
                overflows)
region("HandScaler.update", "an overflow: backoff, count from 0; growth_interval good steps: grow.",
       update, method="update", run=scales, output="the scale after each step", axes=("step",),
       tol=0.0, fixed=lambda: [run(3, [i in (2, 10) for i in range(14)])],
       drawn=lambda g: [run(draw(g, 2, 5), [draw(g, 0, 3) == 0 for _ in range(20)], 2.0 ** draw(
           g, 4, 16), pick(g, (2.0, 4.0)), pick(g, (0.5, 0.25)))],
       mistakes=(("After an overflow it goes on counting the good steps: count from 0 again.",
                  "backoff_factor, 0", "backoff_factor, self.good_steps"),
                 ("It grows the scale one good step late: grow at growth_interval good steps.",
                  "== self.growth_interval", "> self.growth_interval")))
