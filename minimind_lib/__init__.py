"""minimind_lib: the small library the MiniMind course imports (tokenizer, data, model, training).

Importing it sets how OpenMP threads wait, before torch loads (notebook 00_setup shows it; `python
-m benchmarks threads` measures it): a thread that reaches a barrier before its partner spins only
briefly, then sleeps, so on a 2-core machine shared with a browser, JupyterLab or pytest a training
step does not stall while the scheduler gives the partner's core to another process. OpenMP reads
these variables once, when torch loads; if you set either one yourself, yours are kept as they are.
"""

import os

# LLVM's OpenMP (macOS wheels) reads the policy: a waiting thread sleeps; GNU's (Linux wheels) takes
# the explicit
# spin count over it: about 10 µs of spinning first (no cost on a quiet machine), then sleep.
COURSE_OPENMP = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
WAIT_POLICY_SOURCE = "your environment"
if not set(COURSE_OPENMP) & set(os.environ):
    WAIT_POLICY_SOURCE = "minimind_lib"
    os.environ.update(COURSE_OPENMP)

__version__ = "0.1.0"
