#!/usr/bin/env bash
# The prepared GPU check: one run, inside 8 minutes on one GPU, no network. Benchmarks, a short run of the command line,
# then the notebooks that only a GPU can answer, in the gpu-check profile (MiniMind2-small at seq 512, fewer steps,
# checkpoints at the end); every JSON result, executed notebook, figure, cell timing and log goes into
# OUTDIR/gpu_check.tar.gz, and status.txt in it says what ran, what was cut and why.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]        (default: $OUT when set, else build/gpu_check)
#   MINIMIND_PROFILE=smoke bash benchmarks/gpu_check.sh OUTDIR   (the same script on a CPU, benchmarks in tiny sizes
#                   and caps sized for a loaded 2-core CPU: what CI runs, so that a GPU run cannot fail on a script
#                   error; every part must run to its end there)
#
# The budget (gpu-check), seconds, each part capped by `timeout` (GPU_CHECK_SECONDS, default 450, is the hard end;
# the 30 s left of 8 minutes cover starting Python and copying the archive out). benchmarks/README.md's table says
# what each part needs by estimate and why it fits.
#   device facts, the allocator and compile settings (device.txt)                                       5
#   benchmarks (BENCH_SECONDS 245): throughput --baseline 55 (the gpu profile's recipe: the trunk compiled, cold),
#     throughput --baseline --strategy pack 45 (compiled FlexAttention forward and backward), throughput --ablation
#     65 (from 32 x 2 micro-batches to the planner's 64 x 1, compile last), pretrain on the command line 35 (40
#     steps, compiled: the gpu profiles' own path), accumulation 10, batching 15, levers 20                 245
#   notebooks (GPU_CHECK_NOTEBOOKS, "NN:seconds" each): 03 25, 04 40, 05 30, 06 35, 07 40, 08 25; a notebook still
#     running at its deadline is saved as far as it ran (tools/run_course.py --deadline); 08 trains a small start
#     of its own when 07's run is missing (and says so)                                                   195
#   packing the archive                                                                                   ~5
# Not run: 00_setup, 01_tokenizer, 02_data (CPU work: tokenizers, data), 09_beyond_one_gpu (DDP on gloo) and the
# memmap benchmark (tokenizing on the CPU): the CPU runs answer them. A machine without the Jupyter packages gets them
# from wheels in .whl/ (bash benchmarks/fetch_gpu_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
export PYTHONUNBUFFERED=1 MINIMIND_PROFILE="${MINIMIND_PROFILE:-gpu-check}"
# The allocator's setting by its current name (torch reads PYTORCH_ALLOC_CONF; PYTORCH_CUDA_ALLOC_CONF is the older
# alias), unless the caller set either; Inductor's cache in one folder, so that the notebooks and the command line
# reuse what the benchmarks compiled. Both are written into device.txt.
[ -z "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ] && export PYTORCH_ALLOC_CONF=expandable_segments:True
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_gpu_check}"
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
if [ "$MINIMIND_PROFILE" = smoke ]; then  # tiny sizes, caps for a loaded 2-core CPU: the script's every path
  tiny="--steps 1 --repeats 2 --batch 2 --accum 2 --seq 32 --max-samples 40 --threads 1"
  args_baseline="$tiny"; args_ablation="$tiny"; args_pack="$tiny --compile"; args_pretrain="--steps 3 --max-samples 200 --compile --loss-chunk 64"
  args_levers="--batch 2 --seq 32 --accum 1 --steps 1 --max-samples 40 --threads 1 --lever-repeats 1"
  args_accumulation="--batch 4 --k 2"; args_batching="--batches 1 --oom-steps 2 --max-samples 200 --threads 1"
  caps="bench_throughput:240 bench_throughput_pack:300 bench_throughput_ablation:300 pipeline_pretrain:420
        bench_accumulation:60 bench_batching:120 bench_throughput_levers:120"
  notebooks="${GPU_CHECK_NOTEBOOKS:-03:300 04:300 05:300 06:300 07:300 08:300}"
  total=${GPU_CHECK_SECONDS:-3600}; bench_total=${BENCH_SECONDS:-1500}
else
  args_baseline=""; args_ablation="--batch 32 --accum 2"; args_pack=""; args_pretrain="--steps 40"
  args_levers="--only fused_adamw sdpa_backend chunked_cross_entropy pinned_memory"
  args_accumulation=""; args_batching=""
  caps="bench_throughput:55 bench_throughput_pack:45 bench_throughput_ablation:65 pipeline_pretrain:35
        bench_accumulation:10 bench_batching:15 bench_throughput_levers:20"
  notebooks="${GPU_CHECK_NOTEBOOKS:-03:25 04:40 05:30 06:35 07:40 08:25}"
  total=${GPU_CHECK_SECONDS:-450}; bench_total=${BENCH_SECONDS:-245}
fi
cap_of() { local c; for c in $caps; do [ "${c%%:*}" = "$1" ] && echo "${c##*:}"; done; }
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
  echo "allocator: PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-unset} PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-unset}"
  env | grep -E '^(TORCHINDUCTOR|TORCHDYNAMO|TORCH_COMPILE|TORCH_LOGS)' | sort | sed 's/^/compile env: /'
  $py -c "
import torch._dynamo.config as dynamo, torch._inductor.config as inductor
from minimind_lib.profiles import get_profile
p = get_profile()
print(f'compile: profile {p.name} compile={p.compile} loss_chunk={p.loss_chunk} row_multiple={p.row_multiple}; '
      f'dynamo cache_size_limit={dynamo.cache_size_limit} automatic_dynamic_shapes={dynamo.automatic_dynamic_shapes}; '
      f'inductor max_autotune={inductor.max_autotune} fx_graph_cache={inductor.fx_graph_cache}')"
} > "$work/device.txt" 2>&1
cat "$work/device.txt"
note "gpu_check: profile $MINIMIND_PROFILE, budget ${total}s (benchmarks ${bench_total}s, notebooks: $notebooks)"
status=0

# run_part NAME ARGS...: one capped part (CAP: cap_of NAME, and what is left of the bench phase); its stdout goes to
# NAME.json (a benchmark's JSON) or NAME.log, its stderr to NAME.err.
run_part() {
  local name=$1 cap; cap=$(cap_of "$1"); shift
  local t; t=$(left "$bench_total"); [ "$t" -lt "$cap" ] && cap=$t
  if [ "$cap" -lt 5 ]; then note "cut: $name (out of time)"; status=1; return; fi
  local t0 rc; t0=$(date +%s)
  timeout "$cap" "$@" > "$work/$name.${SUFFIX:-json}" 2> "$work/$name.err"
  rc=$?
  if [ $rc -eq 0 ]; then
    note "ran: $name ($(( $(date +%s) - t0 ))s of ${cap}s)"
  else
    note "failed: $name rc=$rc (124 = out of time; see $name.err)"; status=1
  fi
}
# The headline figure first (ours vs MiniMind's recipe, as the profile trains: compiled on a GPU), packed rows through
# compiled FlexAttention, the ladder one change at a time, the command line's own run, then the other benchmarks
# (benchmarks/README.md quotes their JSON).
run_part bench_throughput $py -m benchmarks throughput --baseline $args_baseline --json
run_part bench_throughput_pack $py -m benchmarks throughput --baseline --strategy pack $args_pack --json
run_part bench_throughput_ablation $py -m benchmarks throughput --ablation $args_ablation --json
SUFFIX=log run_part pipeline_pretrain $py -m minimind_lib pretrain --out "$work/runs/cli/pretrain" --no-progress \
  --overwrite $args_pretrain
run_part bench_accumulation $py -m benchmarks accumulation $args_accumulation --json
run_part bench_batching $py -m benchmarks batching $args_batching --json
run_part bench_throughput_levers $py -m benchmarks throughput --levers $args_levers --json

# Then the notebooks, one at a time, each into the work folder (not in place: the caller decides what to commit).
if ! $py -c "import nbclient, nbformat, ipykernel" 2>/dev/null; then
  note "cut: every notebook: nbclient/nbformat/ipykernel not importable (put the wheels in .whl/: benchmarks/fetch_gpu_wheels.sh)"
  status=1
else
  end=$(( total - 5 ))  # room to pack the archive
  for entry in $notebooks; do
    nb=${entry%%:*}; cap=${entry##*:}
    t=$(left "$end"); [ "$t" -lt "$cap" ] && cap=$t
    if [ "$cap" -lt 3 ]; then note "cut: notebook $nb (out of time)"; status=1; continue; fi
    if [ "$nb" = 08 ] && [ ! -f "$MINIMIND_RUNS_DIR/$MINIMIND_PROFILE/pretrain/model.pth" ]; then
      note "note: 07's run is missing (07 did not finish): 08 trains a small start of its own, and says so"
    fi
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
note "not run: 00_setup 01_tokenizer 02_data 09_beyond_one_gpu, bench memmap (the CPU runs answer them)"
note "elapsed $(( $(date +%s) - start ))s status $status"
tar -czf "$out/gpu_check.tar.gz" --exclude="*.pt" --exclude="*.pth" --exclude=cache -C "$work" . && echo "wrote $out/gpu_check.tar.gz"
exit $status
