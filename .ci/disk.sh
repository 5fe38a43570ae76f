# Sourced by the CI stages that make multi-GB venvs (cuda_build_check.sh, version_matrix.sh).
#
# Why: CI runs every stage in one fresh clone on one disk. A PyPI CUDA build of torch is
# ~5 GB in a venv and ~3 GB of wheels while pip installs it; three such venvs plus pip's
# wheel cache filled the CI disk on 2026-12-01 ("[Errno 28] No space left on device" in
# the version matrix, after 1427 s). So: pip keeps no cache here (PIP_NO_CACHE_DIR), each
# stage deletes its venv when it is done unless CI_KEEP_VENVS=1 (local reruns), and the
# free space is printed before every install, so a full disk is named, not guessed.

export PIP_NO_CACHE_DIR=1

free_gib() {  # free_gib DIR: whole GiB free on DIR's filesystem
  df -Pk "$1" | awk 'NR == 2 { printf "%d", $4 / 1048576 }'
}

# disk_check DIR NEED_GIB WHAT: prints the free space; warns when under NEED_GIB.
disk_check() {
  local dir=$1 need=$2 what=$3 free
  mkdir -p "$dir"
  free=$(free_gib "$dir")
  echo "disk: ${free} GiB free on $(df -P "$dir" | awk 'NR == 2 { print $6 }') before $what (needs ~${need} GiB)"
  if ((free < need)); then
    echo "WARNING: ${free} GiB free, ${what} needs ~${need} GiB: it may fail with 'No space left on device'." \
      "Free space (old .ci-cache/venv-*, /tmp) or set CI_CACHE to a bigger disk." >&2
  fi
}

# drop_venv DIR: deletes a stage's venv when the stage is done (kept with CI_KEEP_VENVS=1).
drop_venv() {
  [[ -d $1 ]] || return 0
  if [[ ${CI_KEEP_VENVS:-} == 1 ]]; then
    echo "keeping $1 (CI_KEEP_VENVS=1)"
  else
    rm -rf "$1"
    echo "removed $1 ($(free_gib "$(dirname "$1")") GiB free now; CI_KEEP_VENVS=1 keeps it)"
  fi
}

# ensure_venv VENV SPEC BASE_PYTHON PACKAGES...: VENV, made by BASE_PYTHON with PACKAGES
# installed, unless it already holds SPEC (its .spec file: a kept or prefetched venv). Under an
# exclusive lock on VENV.lock: a stage whose venv .ci/run or the matrix started making in the
# background (prefetch_venv) waits for it here instead of racing it; if that prefetch failed,
# the stage makes the venv itself. Never `pip install --no-compile`: this machine (and CI) sets
# PYTHONDONTWRITEBYTECODE=1, so no .pyc would ever be written and every Python the tests start
# would compile torch's modules from source (the installed suite took 1,137 s instead of 683 s).
ensure_venv() {
  local venv=$1 spec=$2 base=$3
  shift 3
  mkdir -p "$(dirname "$venv")"
  (
    flock 9
    if [[ -z ${CI_PREFETCHING:-} && -f $venv.prefetch.log ]]; then
      echo "its prefetch said:" && sed 's/^/  | /' "$venv.prefetch.log" | tail -n 8 && rm -f "$venv.prefetch.log"
    fi
    if [[ -x $venv/bin/python && -f $venv/.spec && $(cat "$venv/.spec") == "$spec" ]]; then
      echo "ready: $venv (made earlier: a prefetch, or kept with CI_KEEP_VENVS=1)"
    else
      rm -rf "$venv"
      disk_check "$(dirname "$venv")" 9 "the venv $(basename "$venv")"
      "$base" -m venv "$venv"
      "$venv/bin/python" -m pip install -qq "$@"
      echo "$spec" >"$venv/.spec"
    fi
  ) 9>"$venv.lock"
}

# prefetch_venv DIR SCRIPT ARGS...: runs `bash SCRIPT ARGS...` (a stage's --prepare-venv, which
# sets CI_PREFETCHING=1 and writes its own log beside its venv: VENV.prefetch.log, shown by the stage's ensure_venv) in the
# background, when DIR's disk has room for a second venv beside the one in use
# (CI_PREFETCH_MIN_GIB, default 20): pip is mostly download and disk writes, so the venv is made
# while the CPU runs the tests before it.
prefetch_venv() {
  local dir=$1 free
  shift
  mkdir -p "$dir"
  free=$(free_gib "$dir")
  if ((free < ${CI_PREFETCH_MIN_GIB:-20})); then
    echo "prefetch ($*) skipped: ${free} GiB free (< ${CI_PREFETCH_MIN_GIB:-20}); its stage makes the venv" >&2
    return 0
  fi
  echo "prefetch, in the background: $*"
  bash "$@" >/dev/null 2>&1 </dev/null &
}
