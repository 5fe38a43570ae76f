"""Link and compile flags that are facts of the toolchain, not of this project's sources:
the one shared C++ runtime, and the sanitizer flags. Loaded by build.py (also when setup.py
loads build.py by path), which re-exports these names."""

from __future__ import annotations

import os
import re

# The C++ runtime must be the one torch runs with, linked as a shared library. Seen on the
# GPU machine (2026-11-30): its compiler (/opt/gcc/bin/g++, from CXX) links libstdc++
# statically, even for an explicit -lstdc++, so the extension carried a private copy of the
# C++ runtime next to the system libstdc++.so.6 torch uses, and the first std::ostringstream
# in it that formatted an integer crashed (SIGSEGV in every error message with a number in
# it; the failure pytorch/pytorch#109923 describes). Linking the very file torch has loaded,
# by file name (-l:libstdc++.so.6.0.N from its directory), makes it NEEDED and resolves every C++
# runtime reference against it, whatever the compiler's default.
SHARED_CXX_RUNTIME = "libstdc++.so.6"


def shared_cxx_runtime() -> tuple[list[str], list[str]]:
    """(libraries, library_dirs) that link the libstdc++.so.6 this process has loaded.

    torch (imported here) has loaded it; /proc/self/maps says from where. Without that
    file (not Linux, or no libstdc++ loaded) it falls back to the compiler's -lstdc++.
    """
    import torch  # noqa: F401  (libc10 brings libstdc++ in)

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                # The mapped file is the real one (libstdc++.so.6.0.33); its SONAME,
                # libstdc++.so.6, is what the extension will record as NEEDED.
                name = os.path.basename(path)
                if name.startswith(SHARED_CXX_RUNTIME) and os.path.isfile(path):
                    return [":" + name], [os.path.dirname(path)]
    except OSError:
        pass
    return ["stdc++"], []


# Flags that would link a second, private copy of the C++ runtime into the extension; a
# process that already holds torch's libstdc++.so.6 must have exactly one.
STATIC_RUNTIME_FLAGS = ("-static-libstdc++", "-static-libgcc")


def without_static_runtime(command: list[str]) -> list[str]:
    """A linker command without the flags that would link the C++ runtime statically."""
    return [arg for arg in command if arg not in STATIC_RUNTIME_FLAGS]


def sanitizer_flags() -> list[str]:
    """C++ flags for CUBLAS_GUARD_EXT_SANITIZE (e.g. "address,undefined"; .ci/sanitize.sh).

    -O1 and frame pointers for exact reports; every UBSan finding aborts (no recovery), so
    a finding is a failed test, not a line in a log. Loading such a build into Python needs
    the ASan runtime preloaded (LD_PRELOAD, see .ci/sanitize.sh). Empty when unset.
    """
    checks = os.environ.get("CUBLAS_GUARD_EXT_SANITIZE", "").strip()
    if not checks:
        return []
    if not re.fullmatch(r"[a-z,-]+", checks):
        raise ValueError(f"CUBLAS_GUARD_EXT_SANITIZE={checks!r}: expected e.g. 'address,undefined'")
    flags = [f"-fsanitize={checks}", "-O1", "-fno-omit-frame-pointer"]
    if "undefined" in checks.split(","):
        flags.append("-fno-sanitize-recover=undefined")
    return flags
