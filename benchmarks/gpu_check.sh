#!/usr/bin/env bash
# The prepared GPU check: one run, under 8 minutes on one GPU, no network.
# Executes every notebook in the gpu profile (make course's runner) and runs the benchmarks,
# then packs the executed notebooks and JSON results into one archive in the output folder.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]        (default: build/gpu_check; $OUT when the device tool runs it)
#
# A machine without the Jupyter packages gets them from wheels in .whl/ (see benchmarks/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-build/gpu_check}}"
work="build/gpu_check_work"
rm -rf "$work"; mkdir -p "$work" "$out"
export PYTHONUNBUFFERED=1 MINIMIND_PROFILE="${MINIMIND_PROFILE:-gpu}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $py -m minimind_lib info --compact
} | tee "$work/device.txt"
status=0
# Benchmarks first: they are short, and their JSON is the part the README quotes.
for bench in throughput accumulation batching memmap; do
  extra=""
  [ "$bench" = throughput ] && extra="--baseline"
  if $py -m minimind_lib.bench --help | grep -q "$bench"; then
    timeout 120 $py -m minimind_lib.bench "$bench" --json $extra > "$work/bench_$bench.json" 2> "$work/bench_$bench.err" \
      || { echo "bench $bench failed (see bench_$bench.err)"; status=1; }
  fi
done
# Then every notebook, executed into the work folder (not in place: the caller decides what to commit).
timeout 360 $py -m minimind_lib.course --out "$work" --timeout 300 || status=1
tar -czf "$out/gpu_check.tar.gz" -C "$work" . && echo "wrote $out/gpu_check.tar.gz"
exit $status
