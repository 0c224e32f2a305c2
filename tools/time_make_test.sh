#!/usr/bin/env bash
# The stage times of `make test` on a clean clone of this checkout's HEAD: venv, unit, notebooks, each with its wall
# time and the machine's load before and after, and the unit stage's `pytest --durations=20`. Run it on a quiet
# machine (nothing else running): the numbers it prints are what the 25-minute budget of `make test` is about.
#
#   tools/time_make_test.sh                    # one process per stage, as `make test` runs
#   tools/time_make_test.sh 2                  # then each test stage again with 2 pytest-xdist workers
#   OUT=/tmp/times tools/time_make_test.sh 2   # where the logs go (default: a new temporary folder)
#
# The clone gets its own venv (`make venv`, timed: the first stage of a clean clone's `make test`).
set -euo pipefail
workers="${1:-}"
src="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
clone="$out/clone"
rm -rf "$clone"
git clone --quiet "$src" "$clone"
cd "$clone"
cores="$(nproc)"

stage() {  # stage NAME make-arguments...: run `make ARGS`, log it, and print its wall time and the load around it
    local name="$1"
    shift
    local before after start end rc
    before="$(cut -d' ' -f1-3 /proc/loadavg)"
    start="$(date +%s.%N)"
    rc=0
    make "$@" >"$out/$name.log" 2>&1 || rc=$?
    end="$(date +%s.%N)"
    after="$(cut -d' ' -f1-3 /proc/loadavg)"
    printf '%-22s %8.1f s  exit %d  load before %s, after %s  (%s)\n' "$name" "$(awk "BEGIN { print $end - $start }")" "$rc" \
        "$before" "$after" "$out/$name.log" | tee -a "$out/summary.txt"
    tail -n 3 "$out/$name.log" | sed 's/^/    /' | tee -a "$out/summary.txt"
}

echo "$(date -u +%FT%TZ) $(git -C "$clone" rev-parse --short HEAD) on $cores cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" \
    | tee "$out/summary.txt"
stage venv venv .venv/.wandb-installed
stage unit unit
stage notebooks notebooks
if [ -n "$workers" ]; then
    stage "unit-n$workers" unit UNIT_WORKERS="$workers"
    stage "notebooks-n$workers" notebooks NB_WORKERS="$workers"
fi
echo "unit stage, slowest 20:" | tee -a "$out/summary.txt"
sed -n '/slowest 20 durations/,/^$/p' "$out/unit.log" | tee -a "$out/summary.txt"
echo "logs and summary: $out"
