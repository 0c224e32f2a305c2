#!/usr/bin/env bash
# The prepared GPU check: one run, inside 8 minutes on one GPU, no network. Benchmarks, then the notebooks that only a
# GPU can answer, in the gpu-check profile (MiniMind2-small at seq 512, fewer steps, checkpoints at the end); every
# JSON result, executed notebook, figure, cell timing and log goes into OUTDIR/gpu_check.tar.gz, and status.txt in it
# says what ran, what was cut and why.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]        (default: $OUT when set, else build/gpu_check)
#   MINIMIND_PROFILE=smoke bash benchmarks/gpu_check.sh OUTDIR   (the same script on a CPU, benchmarks in tiny sizes
#                   and 4x the time caps: what CI runs, so that a GPU run cannot fail on a script error)
#
# The budget, in seconds from the start, each part capped by `timeout` (GPU_CHECK_SECONDS, default 450, is the hard
# end; the 30 s left of 8 minutes cover starting the machine's Python and copying the archive out):
#   device facts                                                      ~5
#   benchmarks (BENCH_SECONDS 150): throughput --baseline 40, --ablation 40, accumulation 15, batching 20,
#     memmap 15, throughput --levers 30 (each capped, the phase too)  150
#   notebooks (GPU_CHECK_NOTEBOOKS, "NN:seconds" each): 03 35, 04 45, 05 40, 06 50, 07 60, 08 40; a notebook still
#     running at its deadline is saved as far as it ran (tools/run_course.py --deadline)          270
#   packing the archive                                               ~10
#   throughput --baseline --compile (a cold Inductor/Triton compile), optional: whatever is left
# Not run: 00_setup, 01_tokenizer, 02_data (CPU work: tokenizers, data) and 09_beyond_one_gpu (DDP on gloo): the CPU
# runs of the committed notebooks answer them. A machine without the Jupyter packages gets them from wheels in .whl/
# (bash benchmarks/fetch_gpu_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
export PYTHONUNBUFFERED=1 MINIMIND_PROFILE="${MINIMIND_PROFILE:-gpu-check}"
scale=1; [ "$MINIMIND_PROFILE" = smoke ] && scale=4  # smoke: a loaded CI CPU; the caps are a GPU's budget
total=${GPU_CHECK_SECONDS:-$(( 450 * scale ))}
bench_total=${BENCH_SECONDS:-$(( 150 * scale ))}
out="${1:-${OUT:-build/gpu_check}}"
work="$out/work"  # this script's own folder: emptied at the start, packed at the end
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
case "$MINIMIND_PROFILE" in gpu|gpu-check)
  if ! $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: MINIMIND_PROFILE=$MINIMIND_PROFILE but torch sees no CUDA device (set MINIMIND_PROFILE=smoke to try this on a CPU)" >&2
    exit 2
  fi;;
esac
rm -rf "$work"; mkdir -p "$work/timings"
export MINIMIND_RUNS_DIR="$(cd "$work" && pwd)/runs"  # 07 and 08 write their run folders here (metrics in the archive)
if [ "$MINIMIND_PROFILE" = smoke ]; then  # tiny sizes: the script's every path, in seconds
  tiny="--steps 1 --repeats 2 --batch 2 --accum 2 --seq 32 --max-samples 40 --threads 1"
  args_baseline="$tiny"; args_ablation="$tiny"
  args_levers="--batch 2 --seq 32 --accum 1 --steps 1 --max-samples 40 --threads 1 --lever-repeats 1"
  args_accumulation="--batch 4 --k 2"; args_batching="--batches 1 --oom-steps 2 --max-samples 200 --threads 1"
  args_memmap="--max-samples 50 --random-reads 20 --num-workers 1 --hash-bytes 1000000"
  compile_cap=${COMPILE_SECONDS:-4}  # x4: too short for a CPU compile, so the "not measured" path runs
else
  args_baseline=""; args_ablation=""; args_levers=""; args_accumulation=""; args_batching=""; args_memmap=""
  compile_cap=${COMPILE_SECONDS:-120}
fi
notebooks="${GPU_CHECK_NOTEBOOKS:-03:35 04:45 05:40 06:50 07:60 08:40}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "warning: installing .whl/ failed; the notebooks need nbclient+ipykernel" | tee -a "$work/status.txt"
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
left() { echo $(( start + $1 - $(date +%s) )); }  # seconds until start + $1
note() { echo "$*" | tee -a "$work/status.txt"; }
{
  echo "date: $(date -u +%FT%TZ)"
  echo "profile: $MINIMIND_PROFILE"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  $py -m minimind_lib info --compact
  echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset} (how OpenMP threads wait: omp_wait_policy above)"
} > "$work/device.txt" 2>&1
cat "$work/device.txt"
note "gpu_check: profile $MINIMIND_PROFILE, budget ${total}s (benchmarks ${bench_total}s, notebooks: $notebooks)"
status=0

# run_bench FILE CAP ARGS...: one benchmark, capped by CAP seconds and by what is left of the phase that ends
# PHASE_END seconds after the start (default: the bench phase). OPTIONAL=1: running out of time is a note only.
run_bench() {
  local file=$1 cap=$(( $2 * scale )); shift 2
  local t; t=$(left "${PHASE_END:-$bench_total}"); [ "$t" -lt "$cap" ] && cap=$t
  if [ "$cap" -lt 5 ]; then note "cut: bench $file (out of time)"; return; fi
  local t0; t0=$(date +%s)
  timeout "$cap" $py -m benchmarks "$@" --json > "$work/$file.json" 2> "$work/$file.err"
  local rc=$?
  if [ $rc -eq 0 ]; then
    note "ran: bench $file ($(( $(date +%s) - t0 ))s of ${cap}s)"
  elif [ $rc -eq 124 ] && [ "${OPTIONAL:-0}" = 1 ]; then
    note "cut: bench $file, not measured: it needed more than ${cap}s (see $file.err)"
  else
    note "failed: bench $file rc=$rc (124 = out of time; see $file.err)"; status=1
  fi
}
# The headline figure first (ours vs MiniMind's recipe), then what each lever adds to it, the other benchmarks
# (benchmarks/README.md quotes their JSON) and the levers; torch.compile comes last (the slowest to start).
run_bench bench_throughput 40 throughput --baseline $args_baseline
run_bench bench_throughput_ablation 40 throughput --ablation $args_ablation
run_bench bench_accumulation 15 accumulation $args_accumulation
run_bench bench_batching 20 batching $args_batching
run_bench bench_memmap 15 memmap $args_memmap
run_bench bench_throughput_levers 30 throughput --levers $args_levers

# Then the notebooks, one at a time, each into the work folder (not in place: the caller decides what to commit).
if ! $py -c "import nbclient, nbformat, ipykernel" 2>/dev/null; then
  note "cut: every notebook: nbclient/nbformat/ipykernel not importable (put the wheels in .whl/: benchmarks/fetch_gpu_wheels.sh)"
  status=1
else
  end=$(( total - 10 ))  # room to pack the archive
  for entry in $notebooks; do
    nb=${entry%%:*}; cap=${entry##*:}
    t=$(left "$end"); [ "$t" -lt "$cap" ] && cap=$t
    if [ "$cap" -lt 3 ]; then note "cut: notebook $nb (out of time)"; status=1; continue; fi
    t0=$(date +%s)
    timeout $(( cap + 30 )) $py tools/run_course.py --only "$nb" --out "$work" --deadline "$cap" \
      --timings-dir "$work/timings" >> "$work/course.log" 2>&1
    rc=$?
    [ -f "$work/course.json" ] && mv "$work/course.json" "$work/course_$nb.json"
    if [ $rc -eq 0 ]; then
      note "ran: notebook $nb ($(( $(date +%s) - t0 ))s of ${cap}s)"
    elif grep -q "CellTimeoutError" "$work/course_$nb.json" 2>/dev/null; then
      note "cut: notebook $nb at its ${cap}s deadline, saved as far as it ran (see course_$nb.json)"; status=1
    else
      note "failed: notebook $nb rc=$rc (124 = killed; see course.log)"; status=1
    fi
  done
fi
note "not run: 00_setup 01_tokenizer 02_data 09_beyond_one_gpu (the CPU runs of the committed notebooks answer them)"
PHASE_END=$(( total - 10 )) OPTIONAL=1 run_bench bench_throughput_compile "$compile_cap" \
  throughput --baseline --compile $args_baseline
note "elapsed $(( $(date +%s) - start ))s status $status"
tar -czf "$out/gpu_check.tar.gz" --exclude="*.pt" --exclude="*.pth" --exclude=cache -C "$work" . && echo "wrote $out/gpu_check.tar.gz"
exit $status
