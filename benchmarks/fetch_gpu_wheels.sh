#!/usr/bin/env bash
# Download the Jupyter wheels of benchmarks/gpu_wheels.txt into .whl/ (git-ignored), for a GPU machine without
# network or Jupyter. gpu_check.sh installs whatever it finds in .whl/ with pip --no-index --no-deps --target.
#
#   bash benchmarks/fetch_gpu_wheels.sh [PYTHON_VERSION]    (default 3.12: the target GPU machine's python3)
#   WHL_DIR=DIR puts them elsewhere (default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
pyver="${1:-3.12}"
dest="${WHL_DIR:-.whl}"
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
grep -v '^\s*#' benchmarks/gpu_wheels.txt | grep -v '^\s*$' > "$dest/requirements.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${platforms[@]}" -d "$dest" -r "$dest/requirements.txt"
echo "$(ls "$dest"/*.whl | wc -l) wheels, $(du -sh "$dest" | cut -f1), in $dest/ for CPython $pyver"
