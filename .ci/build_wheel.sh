#!/usr/bin/env bash
# build_wheel.sh PYTHON OUTDIR: the project's one wheel, built by PYTHON's pip (its torch is the
# one the locked _C is compiled against) from a clean copy of the tree, into OUTDIR.
# Prints the wheel's path, size and contents' native libraries.
set -euo pipefail
PY=$1
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
# Tracked and untracked-but-not-ignored files that exist: no .venv, build/, *.so (outside a git
# checkout, such as CI's copies of the tree: everything but the build outputs).
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do if [[ -f $f ]]; then printf '%s\0' "$f"; fi; done \
    | tar --null -T - -cf -) | tar -xf - -C "$WORK"
else
  tar -C "$ROOT" --exclude=.git --exclude=.venv --exclude=.ci-cache --exclude=build --exclude=dist \
    --exclude='*.egg-info' --exclude='*.so' --exclude=__pycache__ -cf - . | tar -xf - -C "$WORK"
fi
rm -f "$OUT"/cublas_guard_ext-*.whl
(cd "$WORK" && "$PY" -m pip wheel -v --no-build-isolation --no-deps -w "$OUT" .) >"$OUT/wheel-build.log" 2>&1 \
  || { tail -n 60 "$OUT/wheel-build.log"; echo "build_wheel: failed (log: $OUT/wheel-build.log)" >&2; exit 1; }
grep 'cublas_guard_ext: building' "$OUT/wheel-build.log" || true
wheel=$(ls "$OUT"/cublas_guard_ext-*.whl)
echo "build_wheel: $wheel ($(du -h "$wheel" | cut -f1), $(($(date +%s) - start)) s)"
"$PY" -m zipfile -l "$wheel" | grep -E '\.so|_C\.torch|_core_cuda\.cuda' || true
