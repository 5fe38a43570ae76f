"""Every field an error payload may carry: its name and kind, the one table both sides share.

The native side (csrc/) writes a payload as ``ErrorReport(kind).add("field", value)``;
the classes here read it by the same names. This table is the contract:
tests/errors/test_payload_schema.py reads every ``.add("...")`` key in csrc/ and every field the
Python side reads, and fails when a name is on one side only or outside this table, and
it checks the kinds of real payloads against it (:func:`problems`).

Kinds: ``int``, ``float`` (a JSON number, or the strings "nan", "inf", "-inf" the native
side writes for non-finite values), ``bool``, ``str``, ``ints`` (a list of ints).
"""

from __future__ import annotations

import re
from typing import Any

KINDS = ("int", "float", "bool", "str", "ints")

# The payload's "kind": which exception class a report becomes (parse._BY_KIND; the native
# side's ErrorReport("...") names).
REPORT_KINDS = (
    "cublas",
    "cuda_launch",
    "device_mismatch",
    "dtype",
    "graph_capture",
    "group_offsets",
    "non_finite",
    "non_finite_entry",
    "non_finite_output",
    "out_of_memory",
    "pending_cuda",
    "shape_mismatch",
    "size_limit",
    "watch_from_nowhere",
    "watch_op_failure",
)

# Fields the native side writes, by name.
NATIVE_FIELDS: dict[str, str] = {
    # where
    "layer": "str",
    "role": "str",
    "reason": "str",
    "stage": "str",
    "purpose": "str",
    "device": "str",
    "detail": "str",
    "mode": "str",
    "pass": "str",
    "phase": "str",
    "module": "str",
    "op": "str",
    "backward_node": "str",
    "output_index": "int",
    "anchor": "str",
    # watch's consequence rule: where a non-finite value was born and what it reached;
    # verify_inputs: the op that produced a value finite and the op that read it non-finite
    "birth_stack": "str",
    "detected_stack": "str",  # a birth read after its op returned: where watch read it
    "reached": "str",
    "lost": "str",  # births or findings the record lost, and how to keep more
    "outside": "str",  # an op outside every module of the watched model: which side of it
    "product": "bool",  # the op multiplies its inputs (the overflow note's threshold)
    "name": "str",
    "producer": "str",
    "reader": "str",
    # a grouped GEMM (a mixture of experts): the experts module, its weight's name, the expert
    # a report was raised in and its rows of the sorted input (report/report_place.h); the
    # group offsets and the input's rows (GroupOffsetsError)
    "experts_module": "str",
    "parameter": "str",
    "expert": "int",
    "expert_rows": "ints",
    "offsets": "ints",
    "num_tokens": "int",
    # watch, a grouped GEMM's output: the first bad row is past the last group end (groups_end)
    "past_groups": "bool",
    "groups_end": "int",
    # tensors
    "shape": "ints",
    "strides": "ints",
    "dtype": "str",
    "ndim": "int",
    "numel": "int",
    "expected": "str",
    "expected_last_dim": "int",
    "expected_shape": "str",
    "input_device": "str",
    "weight_device": "str",
    "other_dtype": "str",
    "other_role": "str",
    # non-finite findings
    "nan_count": "int",
    "posinf_count": "int",
    "neginf_count": "int",
    "zero_count": "int",
    "first_bad_index": "int",
    "first_bad_coords": "ints",
    "first_bad_value": "float",
    "deferred": "bool",
    "call": "int",
    "replay": "int",
    # the GEMM
    "status": "int",
    "status_name": "str",
    "api": "str",
    "transa": "str",
    "transb": "str",
    "m": "int",
    "n": "int",
    "k": "int",
    "lda": "int",
    "ldb": "int",
    "ldc": "int",
    "alpha": "float",
    "beta": "float",
    "data_type": "str",
    "compute_type": "str",
    "math_mode": "str",
    "chunk": "str",
    "precheck": "bool",
    "rule": "str",
    "descriptors": "str",
    "gemm_path": "str",  # the cuBLASLt path (cuda/lt_gemm.cu)
    "argument": "str",
    "value": "int",
    "limit": "int",
    # memory (add_memory_fields)
    "free_bytes": "int",
    "total_bytes": "int",
    "torch_allocated_bytes": "int",
    "torch_reserved_bytes": "int",
    "workspace_bytes": "int",
    "bytes_requested": "int",
    # CUDA errors and launches
    "cuda_error": "str",
    "cuda_error_code": "int",
    "cuda_error_string": "str",
    "sticky": "bool",
    "launch_blocking": "bool",
    "kernel": "str",
    "grid": "ints",  # a launch refused before it was made (linear/launch_limits.h)
    "block": "ints",
    "shared_memory_bytes": "int",
    "built_archs": "str",
    "device_name": "str",
    "compute_capability": "str",
    # watch's op inputs (folded by format._fold_inputs into input_names, input_shapes, ...)
    "num_inputs": "int",
}

# Families of native fields with a variable part: (pattern, kind). The prefix is an
# operand ("a", "b", "c" of a GEMM; "tensor" of a dtype report: describe_tensor) or the
# n-th input of an op watch saw ("input0_shape", ...), or a scalar argument ("scalar_alpha").
NATIVE_FAMILIES: tuple[tuple[str, str], ...] = (
    (r"(a|b|c|tensor)_(shape|strides)", "ints"),
    (r"(a|b|c|tensor)_(dtype|device)", "str"),
    (r"(a|b|c)_role", "str"),
    (r"(a|b|c)_(alignment|storage_offset)", "int"),
    (r"input\d+_(shape|strides)", "ints"),
    (r"input\d+_(name|dtype|device)", "str"),
    (r"input\d+_absmax", "float"),
    (r"scalar_\w+", "float"),
)
# The prefixes and suffixes the native side builds family names from, as written in csrc/
# (`describe_tensor(report, "tensor", t)`, `p + "_shape"`): the schema test finds them.
FAMILY_PREFIXES = ("a", "b", "c", "tensor", "input", "scalar_")
FAMILY_SUFFIXES = (
    "_shape",
    "_strides",
    "_dtype",
    "_device",
    "_role",
    "_alignment",
    "_storage_offset",
    "_name",
    "_absmax",
)

# Fields the Python side adds to a report's fields (never in a payload).
PYTHON_FIELDS: dict[str, str] = {
    "rank": "int",
    "world_size": "int",  # base.GuardError under torchrun
    "environment": "dict",  # base.GuardError: facts.error_context()
    "original_error": "str",  # watch._op_failure: the op's own message
    "input_names": "list",
    "input_shapes": "list",
    "input_strides": "list",  # format._fold_inputs
    "input_dtypes": "list",
    "input_devices": "list",
    "input_absmax": "list",  # format._fold_inputs: the inputs' absolute maxima (magnitudes.py)
    "missing": "str",
    "fix": "str",  # ExtensionBuildError, raised by _native/loading/loader.py
    "name": "str",  # NonFiniteEntryError, raised by watching/session.py
    # `python -m cublas_guard_ext run` (cublas_guard_ext/run/): NonFiniteGradientsError, the step
    # check of every optimizer; PeerFailedError, a rank stopped because another failed first
    "optimizer": "str",
    "failed_rank": "int",
    "failed_host": "str",
    "failed_pid": "int",
    "failed_error": "str",
    "failed_report": "str",
    "local_error": "str",
    "when": "str",  # WatchCaptureError: when the capture was asked for
    # TrainingGuard (errors/training_steps.py): NonFiniteStepError, TrainingDivergedError
    "step": "int",
    "loss": "float",
    "bad_gradient_count": "int",
    "bad_gradients": "list",  # the first few parameters' names
    "classification": "str",  # "transient" / "persistent", from the replay
    "finding": "str",  # the replay's watch finding, its message
    "refused_by": "str",  # the guarded layer that refused its input inside the step
    "refusal": "dict",  # that refusal's fields (role, counts)
    "note": "str",
    "history": "list",  # the last steps' loss and gradient norm
    "consecutive_skips": "int",
    "skipped_steps": "list",
    "param_absmax": "float",
    "param_absmax_name": "str",
    "param_dtype": "str",
    # the overflow story (errors/overflow.py): watch's finding at the op ...
    "overflow": "bool",  # +/-Inf alone from finite inputs in float16/bfloat16/fp8: an overflow
    "dtype_max": "float",  # the dtype's largest value
    "overflow_bound": "float",  # a GEMM's K * max|a| * max|b| + max|bias|
    # ... and a guarded layer's refusal of an input with +/-Inf alone (guarded_linear/error_hooks.py)
    "finite_absmax": "float",  # the refused tensor's largest finite magnitude
    "previous_layer": "str",  # the guarded layer that ran before it on this thread
    "previous_in_features": "int",
    "previous_weight_absmax": "float",
    "previous_bias_absmax": "float",
    # ExpertsImplementationError (errors/experts.py): the experts module's class, and notes
    "module_type": "str",
    "notes": "list",
    # TrainingGuard(silent_corruption=...) (errors/corruption.py): SilentCorruptionError
    "verdict": "str",  # "replicas_differ" / "transient" / "persistent"
    "ranks": "list",  # every rank that differed
    "host": "str",  # the named rank's host
    "gpu_uuid": "str",  # its GPU (torch.cuda.get_device_properties(i).uuid); None without CUDA
    "parameter": "str",  # the first differing parameter, by qualified name
    "differing_parameters": "int",
    "what": "str",  # the module's output, the gradient at its input, a parameter's gradient
    "gemm": "str",  # the GEMM inside the module named
    "trigger": "str",  # what started the rerun: a spike, a checked step
    "rerun_loss": "float",
    "comparison": "str",  # bitwise, or the calibrated tolerance
    "replays": "list",  # persistent: each rank's replay of the GEMM capsule
    "exit_code": "int",  # the opt-in process exit code of the verdict
    # watch's finding born in optimizer.step() (errors/optimizer_step.py; "optimizer" and
    # "parameter" above): read from the optimizer when the finding is raised
    "optimizer_step": "int",
    "steps_watched": "int",
    "state": "str",  # exp_avg_sq, momentum_buffer, ... or "the parameter"
    "state_dtype": "str",
    "state_nonfinite": "list",  # (NaN, Inf) now in that state
    "state_absmax": "float",
    "grad_absmax": "float",
    "grad_nonfinite": "int",
    "grad_norm": "float",
    "grad_norm_local": "bool",  # grad_norm is of this rank's DTensor shards (FSDP2)
    "lr": "float",
    "hyper": "dict",  # the param group's other settings
    "also_bad": "list",
    "loss_history": "list",
    "grad_norm_history": "list",
    # watch's entry finding (errors/entries.py): (dim, first, last, size) of the bad positions
    "bad_slices": "list",
    # a SafeLinear refusal inside a watch block (_native_callbacks.typed_error)
    "watch_on": "bool",
    # TrainingGuard's samples (errors/samples.py): the culprits of a bad step, a transient placed,
    # SampleIdsError (ids that cannot name the rows) and SkipListError (a path that cannot be used)
    "samples": "dict",  # ids, rows, where, mapped, note, skip_list, listed
    "placed_by": "str",  # "watch" / "record": what placed a transient step
    "problem": "str",
    "got": "str",
    "index": "int",
    "rows": "list",
    "count": "int",
    "batch_rows": "list",
    "argument_shape": "list",
    "path": "str",
    # FP8 (errors/fp8.py, raised by cublas_guard_ext/fp8/): the operand of a float8 GEMM or cast
    "operand": "str",  # input, weight, grad_output; mat_a, mat_b, scale_a, scale_b, output
    "recipe": "str",  # torchao's recipe: tensorwise, rowwise, rowwise_with_gw_hp, custom
    "fp8_dtype": "str",
    "fp8_max": "float",
    "fp8_tiny": "float",  # the smallest subnormal
    "nan_codes": "int",  # NaN and Inf codes in a float8 operand
    "output": "bool",  # the check of a scaled GEMM's output
    "bad_count": "int",
    # "count" (scale values: bad ones, all) and "problem": as above
    "scale_name": "str",
    "scale_shape": "list",
    "saturated": "int",
    "saturated_fraction": "float",
    "flushed": "int",
    "nonzero": "int",
    "flushed_fraction": "float",
    "saturate_limit": "float",
    "flush_limit": "float",
    "next": "str",  # Fp8ArgumentError: what is wrong, what to do
    # a guarded MoE router's logits near the softmax's saturation (errors/routers.py; "call" above)
    "router": "str",  # the router's qualified name
    "absmax": "float",
    "threshold": "float",
    "one_hot_fraction": "float",  # tokens whose top-1 probability exceeds 0.99
    "tokens": "int",
    # NaN only at an attention's masked-out key positions (errors/masked_operands.py; "op", "module")
    "operands": "str",  # the key/value operands by name
    "positions": "ints",  # the non-finite key positions
    "keys": "int",  # the key dimension's size
    "counts": "list",  # per operand: NaN and Inf counts, as text
    "mask": "str",  # the mask that excluded them, in words
    "out_nan": "int",
    "out_numel": "int",
}

_FAMILIES = tuple((re.compile(pattern), kind) for pattern, kind in NATIVE_FAMILIES)


def kind_of(name: str) -> str | None:
    """The kind of a native payload field, or None if the schema does not know it."""
    if name in NATIVE_FIELDS:
        return NATIVE_FIELDS[name]
    for pattern, kind in _FAMILIES:
        if pattern.fullmatch(name):
            return kind
    return None


def _is(kind: str, value: Any) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return (isinstance(value, (int, float)) and not isinstance(value, bool)) or value in (
            "nan",
            "inf",
            "-inf",
        )
    if kind == "str":
        return isinstance(value, str)
    if kind == "ints":
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return False


def problems(payload: dict[str, Any]) -> list[str]:
    """What in a parsed native payload disagrees with the schema (empty: it agrees)."""
    out = []
    kind = payload.get("kind")
    if kind not in REPORT_KINDS:
        out.append(f"report kind {kind!r} is not in schema.REPORT_KINDS")
    for name, value in payload.items():
        if name == "kind":
            continue
        expected = kind_of(name)
        if expected is None:
            out.append(f"field {name!r} is not in the schema")
        elif not _is(expected, value):
            out.append(f"field {name!r} = {value!r} is not of kind {expected}")
    return out
