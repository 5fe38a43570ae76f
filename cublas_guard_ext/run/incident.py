"""The incident report of one process: the facts of a failure, as JSON and as one HTML page.

:func:`facts` collects what is known when the script dies: the error (class, message, the
guard's fields), where (layer or op, module, phase, step, rank), for a NaN/Inf the statistics
at the producing op (through :mod:`cublas_guard_ext.errors.magnitudes`, the one source watch's
messages use too), the model's module tree with the birth module and its path marked, for a
cuBLAS/CUDA failure the call as cuBLAS got it, the capsule and the doctor's summary, and the
next commands to try for the launcher in use. :func:`write` puts ``<stem>.json`` and
``<stem>.html`` in the report folder (stem: host, rank, local rank, PID) and rewrites the
folder's ``index.html`` when more than one process wrote a report there.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import sys
import traceback
from pathlib import Path
from typing import Any

from ..capsule.contents import GEMM_ARGUMENT_FIELDS
from ..errors import GuardError, magnitudes
from .options import RunOptions
from .ranks import file_stem, identity

FORMAT = "cublas_guard_ext incident report"
VERSION = 1
STAT_FIELDS = ("nan_count", "posinf_count", "neginf_count", "zero_count", "input_absmax")
CALL_FIELDS = (
    "status_name",
    "status",
    "api",
    "purpose",
    "stage",
    *GEMM_ARGUMENT_FIELDS,
    "gemm_path",
    "chunk",
    "device",
)
_CUDA_CLASSES = ("CublasError", "CublasOutOfMemoryError", "PendingCudaError", "CudaLaunchError")
# torch's own messages for a cuBLAS or CUDA failure (an op outside the guard)
_CUDA_TEXT = re.compile(r"CUBLAS_STATUS_|CUDA error|cudaError|CUDA driver error|device-side assert")
_PRODUCT_OPS = ("mm", "matmul", "bmm", "addmm", "linear", "baddbmm", "mul", "pow", "conv", "einsum", "dot")
MAX_TREE_NODES = 400
# NonFiniteStepError's replay classification, as a verdict
VERDICT_OF_REPLAY = {"persistent": "reproducible", "transient": "transient"}
VERDICT_WHERE = ("parameter", "module", "phase", "what", "gemm", "op")


def _finding(exc: BaseException) -> BaseException:
    """The guard's own error in an exception's chain (a wrapper's re-raise keeps it as the
    cause), else the exception itself."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, GuardError):
            return current
        current = current.__cause__ or current.__context__
    return exc


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def statistics(fields: dict[str, Any], op: str | None) -> dict[str, Any] | None:
    """The counts, the inputs' absolute maxima and the range note at the producing op."""
    stats = {name: fields.get(name) for name in STAT_FIELDS if fields.get(name) is not None}
    if not stats:
        return None
    dtype = fields.get("dtype")
    base = str(op or "").split("::")[-1].split(".")[0]
    is_product = any(base.startswith(p) for p in _PRODUCT_OPS)
    absmax = fields.get("input_absmax")
    known = [v for v in absmax or [] if isinstance(v, (int, float))]
    stats.update(
        dtype=dtype,
        counts_line=magnitudes.counts_line(fields),
        magnitude_line=magnitudes.magnitude_line(absmax, dtype, is_product=is_product),
        range_note=magnitudes.range_note(dtype, max(known), is_product=is_product) if known else None,
        shape=fields.get("shape"),
        first_bad_coords=fields.get("first_bad_coords"),
        first_bad_value=fields.get("first_bad_value"),
    )
    return stats


def module_tree(root: Any, marked: str | None) -> dict[str, Any] | None:
    """The model's modules (name, type, depth) with the marked module and its ancestors
    flagged; long untouched branches are cut to their first level."""
    if root is None:
        return None
    on_path: set[str] = set()
    if marked is not None:
        parts = marked.split(".") if marked else []
        on_path = {".".join(parts[:i]) for i in range(len(parts) + 1)}
    nodes = []
    hidden = 0
    for name, module in root.named_modules():
        depth = 0 if not name else name.count(".") + 1
        parent = name.rpartition(".")[0] if "." in name else ("" if name else None)
        # Untouched subtrees show their first level only (on-path parents show all children).
        if name and parent not in on_path and marked is not None and name not in on_path:
            hidden += 1
            continue
        if len(nodes) >= MAX_TREE_NODES:
            hidden += 1
            continue
        children = sum(1 for _ in module.children())
        nodes.append(
            {
                "name": name,
                "type": type(module).__name__,
                "depth": depth,
                "on_path": name in on_path,
                "birth": marked is not None and name == marked,
                "children": children,
            }
        )
    return {"root_type": type(root).__name__, "nodes": nodes, "hidden": hidden}


def value_path(fields: dict[str, Any], module: str | None) -> dict[str, Any] | None:
    """The way the bad value went, as far as the finding carries it."""
    op = fields.get("op")
    if op is None and module is None:
        return None
    phase = fields.get("phase") or "forward"
    reached = fields.get("reached")
    steps = [f"{op or 'the op'} (born here, {phase})"]
    if fields.get("backward_node"):
        steps.append(f"autograd node {fields['backward_node']}")
    if module:
        parts = module.split(".")
        # Up through the enclosing modules only when the value left the model (its output, the
        # loss); otherwise it was stopped inside, at what it reached.
        left_the_model = reached is None or any(w in str(reached) for w in ("model's output", "loss"))
        chain = [".".join(parts[:i]) for i in range(len(parts), 0, -1)] if left_the_model else [module]
        steps += [f"module '{m}'" for m in chain]
        if left_the_model:
            steps.append("the model")
    if reached:
        steps.append(f"reached {reached}")
    return {
        "phase": phase,
        "steps": steps,
        "reached": reached,
        "missing": "watch's finding carries the birth op, its module, its phase and the first "
        "result it reached; the ops the value passed through in between are not recorded",
    }


def _launcher() -> dict[str, Any]:
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID") or env.get("LOCAL_WORLD_SIZE"):
        local = env.get("LOCAL_WORLD_SIZE", "1")
        world = env.get("WORLD_SIZE", local)
        prefix = ["torchrun", f"--nproc-per-node={local}"]
        if world != local and local.isdigit() and world.isdigit() and int(local):
            prefix.append(f"--nnodes={int(world) // int(local)}")
        return {"name": "torchrun", "prefix": prefix}
    return {"name": "python", "prefix": []}


def next_commands(
    options: RunOptions | None, kind: str, capsule: str | None, unattributed: bool
) -> list[dict[str, str]]:
    """Ready-to-paste commands, for the launcher this run used. ``unattributed``: no op named
    yet (a NaN seen by a layer's input check, a CUDA error of an unguarded op): --watch names it."""
    target = options.target() if options is not None else sys.argv
    flags = options.run_flags() if options is not None else []
    launcher = _launcher()
    torchrun = launcher["name"] == "torchrun"

    def run_cmd(extra: list[str], env: str = "") -> str:
        head = [*launcher["prefix"], "-m"] if torchrun else ["python", "-m"]
        words = [*head, "cublas_guard_ext", "run", *extra, *target]
        return (env + " " if env else "") + shlex.join(words)

    out: list[dict[str, str]] = []
    if capsule:
        out.append(
            {
                "what": "replay the failing cuBLAS call alone (does it fail by itself?)",
                "command": shlex.join(["python", "-m", "cublas_guard_ext", "replay", capsule]),
            }
        )
        out.append(
            {
                "what": "compare this machine with the one the capsule recorded",
                "command": shlex.join(["python", "-m", "cublas_guard_ext", "doctor", "--capsule", capsule]),
            }
        )
    if kind == "cuda":
        sanitizer = ["compute-sanitizer", "python", *target]
        if torchrun:
            sanitizer = [*launcher["prefix"], "--no-python", *sanitizer]
        out.append(
            {
                "what": "find the kernel that wrote out of bounds (the caching allocator off, or it "
                "hides them)",
                "command": "PYTORCH_NO_CUDA_MEMORY_CACHING=1 " + shlex.join(sanitizer),
            }
        )
        out.append(
            {
                "what": "make every kernel report its own error (slow; the failing op is then exact)",
                "command": run_cmd(flags, "CUDA_LAUNCH_BLOCKING=1"),
            }
        )
    if unattributed and options is not None and not options.watch:
        what = (
            "name the op and module where the NaN/Inf is born, forward and backward"
            if kind == "nonfinite"
            else "name the failing op and its module (watch re-raises cuBLAS/CUDA errors of any op)"
        )
        out.append({"what": what, "command": run_cmd([f for f in flags if f != "--watch"] + ["--watch"])})
    if kind == "cuda":
        out.append(
            {
                "what": "check the CUDA/cuBLAS environment",
                "command": "python -m cublas_guard_ext doctor",
            }
        )
    return out


def _doctor(kind: str) -> dict[str, Any] | None:
    """The doctor's checklist (no live probe: the context may be broken), for CUDA failures."""
    if kind != "cuda":
        return None
    try:
        from .._native.machine import facts as native_facts
        from ..tools import doctor

        env = native_facts.environment()
        items = doctor.checks(env, probe=False)
        return {"summary": doctor.summary(items), "text": doctor.render(items, env)}
    except Exception as err:
        return {"summary": None, "text": f"doctor could not run here: {type(err).__name__}: {err}"}


def facts(
    exc: BaseException,
    options: RunOptions | None,
    *,
    step: int | None = None,
    root: Any = None,
    peer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the report shows, as plain JSON-able data."""
    finding = _finding(exc)
    fields: dict[str, Any] = dict(getattr(finding, "fields", {}) or {})
    for name in STAT_FIELDS:  # fields watch's findings may carry as attributes only
        if name not in fields and getattr(finding, name, None) is not None:
            fields[name] = getattr(finding, name, None)
    cls = type(finding).__name__
    message = str(finding)
    if cls in _CUDA_CLASSES or (not isinstance(finding, GuardError) and _CUDA_TEXT.search(message)):
        kind = "cuda"  # a guarded call's, or an unguarded op's (torch's own RuntimeError)
    else:
        kind = "nonfinite" if "NonFinite" in cls else "other"
    op = fields.get("op")
    module = fields.get("module")
    layer = fields.get("layer")
    if module is None and layer and not str(layer).startswith("<"):
        module = layer  # a guarded Linear: its qualified name is the module
    if fields.get("role") in ("parameter", "buffer") and fields.get("name"):  # watch's entry check
        module = str(fields["name"]).rpartition(".")[0]
    capsule = getattr(finding, "capsule", None)
    who = identity()
    call = _cublas_call(finding, fields) if kind == "cuda" else None
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return _plain(
        {
            "format": FORMAT,
            "version": VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **who,
            "stem": file_stem(who),
            "command": options.command if options is not None else sys.argv,
            "target": options.target() if options is not None else sys.argv,
            "options": options.run_flags() if options is not None else [],
            "launcher": _launcher()["name"],
            "error": {
                "class": cls,
                "raised_as": type(exc).__name__ if finding is not exc else None,
                "kind": getattr(finding, "kind", None),
                "message": str(finding),
                "traceback": "".join(tb)[-8000:],
            },
            "where": {
                "layer": layer,
                "op": op,
                "module": module,
                "phase": fields.get("phase") or fields.get("pass") or fields.get("purpose"),
                "step": step,
                "rank": who["rank"],
                "reached": fields.get("reached"),
                "backward_node": fields.get("backward_node"),
            },
            "verdict": verdict_facts(cls, fields, capsule),
            "statistics": statistics(fields, op),
            "module_tree": module_tree(root, module) if module is not None else None,
            "path": value_path(fields, module) if kind == "nonfinite" and op else None,
            "cublas_call": call,
            "capsule": capsule,
            "capsule_note": getattr(finding, "capsule_note", None),
            "doctor": _doctor(kind),
            "next_commands": next_commands(options, kind, capsule, _unattributed(kind, fields)),
            "next_steps": _next_steps(finding),
            "peer": peer,
            "fields": {k: v for k, v in fields.items() if k != "environment"},
        }
    )


def verdict_facts(cls: str, fields: dict[str, Any], capsule: str | None) -> dict[str, Any] | None:
    """A training step's rerun verdict (TrainingGuard), in Megatron's vocabulary and more: a
    SilentCorruptionError's (replicas_differ, transient, persistent), or a NonFiniteStepError's
    replay (its ``persistent``, "the replay is non-finite again", is ``reproducible`` here)."""
    verdict = fields.get("verdict")
    if verdict is None and "NonFiniteStep" in cls and fields.get("classification") in VERDICT_OF_REPLAY:
        verdict = VERDICT_OF_REPLAY[fields["classification"]]
    if verdict is None:
        return None
    return {
        "verdict": verdict,
        "step": fields.get("step"),
        "rank": fields.get("rank"),
        "ranks": fields.get("ranks"),
        "host": fields.get("host"),
        "device": fields.get("device"),
        "gpu_uuid": fields.get("gpu_uuid"),
        "where": {k: fields[k] for k in VERDICT_WHERE if fields.get(k) is not None},
        "trigger": fields.get("trigger"),
        "comparison": fields.get("comparison"),
        "replays": fields.get("replays"),
        "exit_code": fields.get("exit_code"),
        "capsule": capsule,
    }


def _cublas_call(finding: BaseException, fields: dict[str, Any]) -> dict[str, Any] | None:
    """The GEMM as cuBLAS got it: the call's arguments, the status and what it means (CublasError's
    properties), the operands A, B, C."""
    call = {k: fields[k] for k in CALL_FIELDS if k in fields}
    if "status" in fields:
        for name in ("status_name", "meaning"):
            if getattr(finding, name, None) is not None:
                call[name] = getattr(finding, name)
    for prefix in ("a", "b", "c"):
        for part in ("shape", "strides", "dtype", "role"):
            if f"{prefix}_{part}" in fields:
                call[f"{prefix}_{part}"] = fields[f"{prefix}_{part}"]
    return call or None


def _unattributed(kind: str, fields: dict[str, Any]) -> bool:
    """No op named: a NaN seen at a layer's input (born elsewhere), or a CUDA error of an op
    outside the guard (a guarded layer's own failure names its layer)."""
    if kind == "nonfinite":
        return fields.get("op") is None
    return kind == "cuda" and fields.get("op") is None and fields.get("layer") is None


def _next_steps(finding: BaseException) -> list[str]:
    try:
        return list(finding._next_steps()) if isinstance(finding, GuardError) else []
    except Exception:
        return []


def _write_text(path: Path, text: str) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # ranks may share a folder
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def write(data: dict[str, Any], folder: str) -> tuple[Path | None, str | None]:
    """Write ``<stem>.json`` and ``<stem>.html`` (and the index); (html path, None) or (None, why)."""
    from . import report_html

    try:
        target = Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        json_path = target / f"{data['stem']}.json"
        html_path = target / f"{data['stem']}.html"
        data = dict(data, report=str(html_path), report_json=str(json_path))
        _write_text(json_path, json.dumps(data, indent=2, default=str))
        _write_text(html_path, report_html.render(data))
        write_index(target)
        return html_path, None
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"


def write_index(folder: Path) -> Path | None:
    """index.html over every report in ``folder``, when there are several."""
    from . import report_html

    reports = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("format") == FORMAT:
            reports.append(data)
    if len(reports) < 2:
        return None
    index = folder / "index.html"
    _write_text(index, report_html.render_index(reports))
    return index
