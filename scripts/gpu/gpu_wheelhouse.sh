#!/usr/bin/env bash
# The wheels scripts/gpu/gpu_check.sh installs on the GPU machine, whose Python lacks nemofp4-train's
# configuration layer: the distributions of scripts/gpu/gpu_image.py's WHEELHOUSE at the versions of
# requirements/dev.txt, pure Python only (py3-none-any), into a git-ignored folder (default .wheelhouse,
# about 0.4 MB). Needs network access to the package index; run it once on the CPU machine.
#
#   bash scripts/gpu/gpu_wheelhouse.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
dest=${1:-.wheelhouse}
mapfile -t specs < <("$PY" scripts/gpu/gpu_image.py wheelhouse)
rm -rf "$dest" && mkdir -p "$dest"
for spec in "${specs[@]}"; do
    # a pure-Python wheel from the index; for a release published as source only (antlr4-python3-runtime
    # 4.9.3), the wheel built from it here
    "$PY" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 -d "$dest" "$spec" 2>/dev/null ||
        "$PY" -m pip wheel -q --no-deps -w "$dest" "$spec"
done
impure=$(find "$dest" -name '*.whl' ! -name '*-none-any.whl')
[[ -z "$impure" ]] || { echo "not pure Python: $impure" >&2; exit 1; }
count=$(find "$dest" -name '*.whl' | wc -l)
[[ "$count" -eq "${#specs[@]}" ]] || { echo "expected ${#specs[@]} wheels in $dest, found $count" >&2; exit 1; }
du -sh "$dest" | sed "s|\$| (${specs[*]})|"
