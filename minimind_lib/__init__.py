"""minimind_lib: the small library the MiniMind course imports (tokenizer, data, model, training).

Importing it sets OpenMP's wait policy before torch loads (notebook 00_setup shows it): an OpenMP thread that waits
for its partner at a barrier then sleeps instead of spinning, so on a 2-core machine shared with a browser, JupyterLab
or pytest the training step does not stall while the scheduler gives the partner's core to another process. OpenMP
reads the variable once, when torch loads it: a value already in the environment wins."""

import os

WAIT_POLICY_SOURCE = "your environment" if "OMP_WAIT_POLICY" in os.environ else "minimind_lib"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
