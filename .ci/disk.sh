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
