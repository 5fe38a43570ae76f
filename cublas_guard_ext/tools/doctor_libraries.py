"""The doctor's checks on the CUDA libraries this process loaded (which file each came
from, copies mapped twice, libcublas and libcublasLt from two folders, cuBLAS wheels of
two CUDA majors), the known-bad builds, the CUDA the extension was compiled with, and its
missing CUDA kernels; and the "loaded vs installed" block of the report (the layout of
flashinfer's collect_env: one line per copy with its folder and pip provenance, a marker on
each real conflict). Each check is a function of the facts it is given (``library_facts``
gathers them), so the tests fake them."""

from __future__ import annotations

import os
from typing import Any

import torch

from .._native.building import toolkit
from .._native.machine import known_builds, libraries
from .._native.machine.facts import FAIL, OK, SKIP, WARN
from .doctor_cublas import Check

CONFLICT_MARK = "<-- CONFLICT"


def library_facts(own_path: str | None = None) -> dict[str, Any]:
    """Everything the checks below read, as plain data (``--json``'s ``cuda_libraries``):
    libraries.snapshot() plus what the known-bad table needs."""
    facts = libraries.snapshot(own_path)
    lt = (facts["loaded"].get("libcublasLt") or [{}])[0].get("path")
    facts["lt_missing_symbols"] = [
        symbol
        for symbol in ("cublasLtGroupedMatrixLayoutCreate",)
        if lt and libraries.exports(lt, symbol) is False
    ]
    facts["pip_toolkit_command"] = toolkit.pip_toolkit_command() if torch.version.cuda else None
    return facts


def _conflict_name(conflict: dict[str, Any]) -> str:
    """One row name per conflict (two conflicts may concern one library)."""
    if conflict["kind"] == "mapped_twice":
        return f"loaded libraries: {conflict['library']} mapped twice"
    return "loaded libraries: libcublas and libcublasLt folders"


def _precise_cublas(lib_facts: dict[str, Any], cublas: dict[str, Any] | None) -> str | None:
    """The loaded cuBLAS's version, as precise as known: the installed wheel's four parts when
    they agree with the three the library reports."""
    loaded = (lib_facts.get("loaded", {}).get("libcublas") or [{}])[0].get("version")
    wheel = ((cublas or {}).get("installed") or {}).get("version")
    if loaded and wheel and known_builds.version_tuple(wheel)[:3] == known_builds.version_tuple(loaded)[:3]:
        return wheel
    return loaded


def library_checks(env: dict[str, Any]) -> list[Check]:
    lib_facts = env.get("cuda_libraries")
    if lib_facts is None:  # not gathered (a test's synthetic machine): the build's own facts only
        return _extension_cuda_checks(env, {})
    out: list[Check] = []
    conflicts = lib_facts.get("conflicts") or []
    loaded_conflicts = [c for c in conflicts if c["kind"] in ("mapped_twice", "split_cublas")]
    for conflict in loaded_conflicts:
        out.append(Check(_conflict_name(conflict), FAIL, conflict["message"], conflict["fix"]))
    if not loaded_conflicts:
        loaded = {
            k: v for k, v in (lib_facts.get("loaded") or {}).items() if v and k != libraries.OWN_LIBRARY
        }
        out.append(
            Check(
                "loaded libraries",
                OK,
                "one copy each, libcublas and libcublasLt side by side: "
                + ", ".join(f"{k} {v[0].get('version') or '?'}" for k, v in loaded.items())
                if loaded
                else "no CUDA library is loaded"
                + (" (a CPU-only torch)" if not env.get("torch_cuda") else " yet (no CUDA call has run)"),
            )
        )
    mixed = [c for c in conflicts if c["kind"] == "cuda_majors_mixed"]
    dists = lib_facts.get("cublas_distributions") or []
    if mixed:
        out.append(Check("cuBLAS wheels' CUDA", FAIL, mixed[0]["message"], mixed[0]["fix"]))
    else:
        out.append(
            Check(
                "cuBLAS wheels' CUDA",
                OK,
                ", ".join(f"{d['name']} {d['version']}" for d in dists) + ": one CUDA major"
                if dists
                else "no cuBLAS wheel installed",
            )
        )
    out.append(_known_bad_check(env, lib_facts))
    out += _extension_cuda_checks(env, lib_facts)
    return out


def _known_bad_check(env: dict[str, Any], lib_facts: dict[str, Any]) -> Check:
    cublas = _precise_cublas(lib_facts, env.get("cublas"))
    runtime = (lib_facts.get("loaded", {}).get("libcudart") or [{}])[0].get("version")
    facts = {
        "cublas": cublas,
        "cuda_runtime": runtime,
        "compute_capabilities": [d.get("compute_capability") for d in env.get("devices") or []],
        "lt_missing_symbols": lib_facts.get("lt_missing_symbols") or [],
    }
    rows = known_builds.matching(facts)
    if rows:
        row = rows[0]
        return Check(
            "known-bad builds",
            row.status,
            f"{row.name}: {row.what} (source: {row.source})"
            + (f"; also: {', '.join(r.name for r in rows[1:])}" if rows[1:] else ""),
            row.fix,
        )
    if not cublas:
        return Check("known-bad builds", SKIP, "could not check: libcublas is not loaded in this process")
    return Check(
        "known-bad builds",
        OK,
        f"cuBLAS {cublas} on compute capability {', '.join(filter(None, facts['compute_capabilities'])) or '-'}"
        f": none of the {len(known_builds.KNOWN_BAD_BUILDS)} known-bad builds",
    )


def _extension_cuda_checks(env: dict[str, Any], lib_facts: dict[str, Any]) -> list[Check]:
    ext = env.get("extension") or {}
    torch_cuda = env.get("torch_cuda")
    if not torch_cuda:
        return [
            Check("extension's CUDA", SKIP, f"not applicable: torch {env.get('torch')} is a CPU-only build")
        ]
    if not ext.get("cuda_compiled"):
        return [
            Check(
                "extension's CUDA",
                FAIL if env.get("cuda_available") else WARN,
                f"torch {env.get('torch')} is a CUDA build, but the extension has no CUDA kernels: "
                "CUDA tensors raise ExtensionBuildError"
                + ("" if env.get("cuda_available") else " (no GPU here, so nothing fails on this machine)"),
                f"{lib_facts.get('pip_toolkit_command') or toolkit.pip_toolkit_command()}, then "
                "pip install --no-build-isolation -e .",
            )
        ]
    compiled = ext.get("cuda_compiled_version")
    if not compiled:
        return [Check("extension's CUDA", WARN, "the extension does not say which CUDA compiled it")]
    built = f"{int(compiled) // 1000}.{int(compiled) % 1000 // 10}"
    if built.split(".")[0] != str(torch_cuda).split(".")[0]:
        return [
            Check(
                "extension's CUDA",
                WARN,
                f"the extension was compiled by nvcc of CUDA {built}, torch runs CUDA {torch_cuda}: code "
                "of one CUDA major loaded under another fails (flashinfer #5145)",
                "rebuild with a toolkit of torch's CUDA: "
                + toolkit.pip_toolkit_command(torch_cuda=torch_cuda),
            )
        ]
    return [Check("extension's CUDA", OK, f"compiled by nvcc of CUDA {built}, torch's CUDA {torch_cuda}")]


def render_libraries(lib_facts: dict[str, Any] | None) -> list[str]:
    """Loaded vs installed, one line per copy: key, version, path, provenance, and a marker
    on each copy that is part of a real conflict."""
    if not lib_facts:
        return []
    stray = {os.path.realpath(c["stray"]) for c in lib_facts.get("conflicts") or [] if c.get("stray")}
    involved = {os.path.realpath(p) for c in lib_facts.get("conflicts") or [] for p in c.get("paths") or []}

    def origin(copy: dict[str, Any]) -> str:
        parts = []
        entry = copy.get("ld_library_path_entry") or (
            os.path.dirname(copy["path"]) if copy.get("source") == "LD_LIBRARY_PATH" else None
        )
        if entry:
            parts.append(f"LD_LIBRARY_PATH entry {entry}")
        elif copy.get("source") and copy["source"] != "site-packages":
            parts.append(copy["source"])
        parts.append(f"pip: {copy['distribution']}" if copy.get("distribution") else "no pip wheel")
        return ", ".join(parts)

    def mark(path: str) -> str:
        real = os.path.realpath(path)
        return f"  {CONFLICT_MARK}" + (" (stray)" if real in stray else "") if real in involved else ""

    lines = ["  CUDA libraries loaded (/proc/self/maps):"]
    any_loaded = False
    for key, copies in (lib_facts.get("loaded") or {}).items():
        for copy in copies:
            any_loaded = True
            lines.append(
                f"    {key:<16} {str(copy.get('version') or '?'):<9} {copy['path']}  ({origin(copy)}){mark(copy['path'])}"
            )
    if not any_loaded:
        lines.append("    none")
    others = [
        (key, copy)
        for key, copies in (lib_facts.get("installed") or {}).items()
        for copy in copies
        if not copy.get("loaded")
    ]
    lines.append("  other copies installed (LD_LIBRARY_PATH, CUDA_HOME, site-packages, ldconfig -p):")
    for key, copy in others:
        lines.append(f"    {key:<16} {copy['path']}  ({origin(copy)}){mark(copy['path'])}")
    if not others:
        lines.append("    none")
    return lines
