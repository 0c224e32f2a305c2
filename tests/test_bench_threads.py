"""`python -m benchmarks threads`: each setting's child runs with the environment it names, and the result has the
paired ratios (smallest sizes: the times themselves are not checked, only that they were measured)."""

from __future__ import annotations

import json

from benchmarks import threads


def test_bench_threads_runs_each_setting_as_it_says():
    r = threads.main(["--profile", "smoke", "--steps", "1", "--repeats", "1", "--conditions", "quiet"])
    json.dumps(r)  # JSON-ready
    given = {name: {k: r["settings"][name][k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
             for name in r["settings"]}
    assert given["course"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
    assert given["default"] == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}  # torch's own: nothing set
    assert given["passive"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
    assert r["settings"]["one_thread"]["threads"] == 1
    for key in ("s_per_step_quiet_default", "s_per_step_quiet_course", "s_per_step_quiet_one_thread",
                "ratio_quiet_default_vs_course", "ratio_quiet_one_thread_vs_course"):
        assert r[key]["min"] <= r[key]["median"] <= r[key]["max"] and r[key]["min"] > 0, key
    assert not any(key.startswith("ratio_loaded") for key in r) and r["fastest_quiet"] in r["settings"]
