#!/usr/bin/env bash
# The prepared GPU check: one run, under 8 minutes on one GPU, no network.
# Runs the benchmarks, then executes every notebook in the gpu profile (make course's runner),
# and packs the executed notebooks, figures and JSON results into one archive in the output folder.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]        (default: $OUT when set, else build/gpu_check)
#
# Time: a hard deadline of GPU_CHECK_SECONDS (default 450 s) from the start. The benchmarks get at most
# BENCH_SECONDS (default 170 s) of it, each under its own cap; the course gets what is left minus
# COMPILE_SECONDS (default 45 s) and 15 s for packing; `throughput --baseline --compile` (optional: a cold
# Inductor/Triton compile) runs last in whatever is left. Anything cut short leaves its partial output and a
# note in the archive (status.txt).
# A machine without the Jupyter packages gets them from wheels in .whl/ (bash benchmarks/fetch_gpu_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
total=${GPU_CHECK_SECONDS:-450}
bench_total=${BENCH_SECONDS:-170}
compile_reserve=${COMPILE_SECONDS:-45}
out="${1:-${OUT:-build/gpu_check}}"
work="build/gpu_check_work"
rm -rf "$work"; mkdir -p "$work" "$out"
export PYTHONUNBUFFERED=1 MINIMIND_PROFILE="${MINIMIND_PROFILE:-gpu}"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
if [ "$MINIMIND_PROFILE" = gpu ] && ! $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: MINIMIND_PROFILE=gpu but torch sees no CUDA device (set MINIMIND_PROFILE=smoke to try this on a CPU)" >&2
  exit 2
fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "warning: installing .whl/ failed; the course needs nbclient+ipykernel" | tee -a "$work/status.txt"
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
left() { echo $(( start + $1 - $(date +%s) )); }  # seconds until start + $1
{
  echo "date: $(date -u +%FT%TZ)"
  echo "profile: $MINIMIND_PROFILE"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  $py -m minimind_lib info --compact
} 2>&1 | tee "$work/device.txt"
status=0
names=$($py -m benchmarks --help 2>/dev/null | sed -n 's/^benchmarks: //p' | tr ',' ' ')

# run_bench FILE CAP ARGS...: one benchmark, capped by CAP seconds and by what is left of the phase that ends
# PHASE_END seconds after the start (default: the bench phase). OPTIONAL=1: running out of time is a note only.
run_bench() {
  local file=$1 cap=$2; shift 2
  local t; t=$(left "${PHASE_END:-$bench_total}"); [ "$t" -lt "$cap" ] && cap=$t
  if [ "$cap" -lt 10 ]; then echo "skipped $file: out of time" | tee -a "$work/status.txt"; return; fi
  echo "bench $* (cap ${cap}s)"
  timeout "$cap" $py -m benchmarks "$@" --json > "$work/$file.json" 2> "$work/$file.err"
  local rc=$?
  if [ $rc -eq 124 ] && [ "${OPTIONAL:-0}" = 1 ]; then
    echo "bench $file not measured: it needed more than ${cap}s (see $file.err)" | tee -a "$work/status.txt"
  elif [ $rc -ne 0 ]; then
    echo "bench $file failed rc=$rc (see $file.err)" | tee -a "$work/status.txt"; status=1
  fi
}
# The headline figure first (ours vs MiniMind's recipe), then the other short benchmarks, whose JSON
# benchmarks/README.md quotes, then the levers; torch.compile comes after the course (the slowest to start).
has_throughput=0
case " $names " in *" throughput "*) has_throughput=1 ;; esac
[ $has_throughput = 1 ] && run_bench bench_throughput 80 throughput --baseline
for bench in $names; do
  [ "$bench" = throughput ] || run_bench "bench_$bench" 40 "$bench"
done
[ $has_throughput = 1 ] && run_bench bench_throughput_levers 60 throughput --levers

# Then every notebook, executed into the work folder (not in place: the caller decides what to commit).
if ! $py -c "import nbclient, nbformat, ipykernel" 2>/dev/null; then
  echo "course skipped: nbclient/nbformat/ipykernel not importable (put the wheels in .whl/: benchmarks/fetch_gpu_wheels.sh)" \
    | tee -a "$work/status.txt"; status=1; jupyter=0
else
  jupyter=1; t=$(( $(left "$total") - 15 - compile_reserve ))
fi
if [ $jupyter = 0 ]; then
  :
elif [ "$t" -ge 30 ]; then
  echo "course (timeout ${t}s)"
  timeout "$t" $py tools/run_course.py --out "$work" --timeout 300 2>&1 | tee "$work/course.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && { echo "course rc=$rc (124 = out of time; see course.log)" | tee -a "$work/status.txt"; status=1; }
else
  echo "course skipped: out of time" | tee -a "$work/status.txt"; status=1
fi
[ $has_throughput = 1 ] && PHASE_END=$(( total - 15 )) OPTIONAL=1 run_bench bench_throughput_compile 120 \
  throughput --baseline --compile
echo "elapsed $(( $(date +%s) - start ))s status $status" | tee -a "$work/status.txt"
tar -czf "$out/gpu_check.tar.gz" -C "$work" . && echo "wrote $out/gpu_check.tar.gz"
exit $status
