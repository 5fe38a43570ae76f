"""The incident report's facts and pages, in this process (no script is run): the statistics
through errors/magnitudes.py (with the fields watch's findings gain: zero_count, input_absmax),
the finding inside a wrapper's exception, per-rank names, the index, the launcher's commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.errors import magnitudes
from cublas_guard_ext.run import incident, options, ranks, report_html

from helpers.run_scripts import ReportPage


def overflow_finding() -> cg.NonFiniteOutputError:
    """A float16 overflow at a matmul, as watch reports it (with the two new fields)."""
    return cg.NonFiniteOutputError(
        op="aten.mm.default",
        module="blocks.1.mlp.up",
        phase="forward",
        nan_count=0,
        posinf_count=5,
        neginf_count=2,
        zero_count=3,
        input_absmax=[70000.0, 1.5],
        first_bad_index=4,
        shape=[4, 8],
        dtype="Half",
        device="cuda:0",
        reached="the model's output",
    )


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"mlp": nn.ModuleDict({"up": nn.Linear(8, 8)})}) for _ in range(2)
        )


def test_the_statistics_come_from_magnitudes_and_reach_the_page(tmp_path: Path) -> None:
    err = overflow_finding()
    data = incident.facts(err, options.parse(["train.py"]), step=7, root=Net())
    stats = data["statistics"]
    assert stats["zero_count"] == 3 and stats["input_absmax"] == [70000.0, 1.5]
    assert stats["counts_line"] == magnitudes.counts_line(err.fields) == "NaN 0, +Inf 5, -Inf 2, zeros 3"
    assert stats["range_note"] == "70000 exceeds the float16 range 65504"
    assert stats["magnitude_line"] == magnitudes.magnitude_line(
        [70000.0, 1.5], "torch.float16", is_product=True
    )
    assert data["where"] == {
        "layer": None,
        "op": "aten.mm.default",
        "module": "blocks.1.mlp.up",
        "phase": "forward",
        "step": 7,
        "rank": None,
        "reached": "the model's output",
        "backward_node": None,
    }
    assert data["path"]["steps"] == [
        "aten.mm.default (born here, forward)",
        "module 'blocks.1.mlp.up'",
        "module 'blocks.1.mlp'",
        "module 'blocks.1'",
        "module 'blocks'",
        "the model",
        "reached the model's output",
    ]
    html_path, problem = incident.write(data, str(tmp_path))
    assert problem is None
    page = ReportPage()
    page.feed(html_path.read_text())
    assert page.birth_ops == ["aten.mm.default"] and page.birth_modules == ["blocks.1.mlp.up"]
    assert set(page.path_modules) == {"", "blocks", "blocks.1", "blocks.1.mlp"}
    text = " ".join(page.stats_text)
    assert "NaN 0, +Inf 5, -Inf 2, zeros 3" in text and "70000 exceeds the float16 range 65504" in text
    assert "1.5" in text and page.external == []
    beside = json.loads((tmp_path / f"{data['stem']}.json").read_text())
    assert beside["statistics"] == stats and beside["where"] == data["where"]


def test_a_finding_inside_a_wrappers_exception_is_the_one_reported() -> None:
    try:
        try:
            raise overflow_finding()
        except cg.NonFiniteOutputError as inner:
            raise RuntimeError("trainer step failed") from inner
    except RuntimeError as outer:
        data = incident.facts(outer, None)
    assert data["error"]["class"] == "NonFiniteOutputError" and data["error"]["raised_as"] == "RuntimeError"
    assert data["where"]["op"] == "aten.mm.default"


def test_a_plain_error_has_no_statistics_tree_or_path() -> None:
    data = incident.facts(KeyError("batch"), None, root=Net())
    assert data["error"]["class"] == "KeyError" and data["statistics"] is None
    assert data["module_tree"] is None and data["path"] is None and data["cublas_call"] is None


def test_files_are_named_by_host_rank_local_rank_and_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    who = ranks.identity()
    assert (who["rank"], who["local_rank"]) == (5, 1)
    assert ranks.file_stem({"host": "gpu node/3", "rank": 5, "local_rank": 1, "pid": 42}) == (
        "gpu_node_3-rank5-local1-pid42"
    )
    assert ranks.file_stem({"host": "h", "rank": None, "local_rank": None, "pid": 7}) == "h-pid7"


def test_the_index_lists_every_rank_the_failed_one_first(tmp_path: Path) -> None:
    first = incident.facts(overflow_finding(), None)
    first.update(rank=1, stem="h-rank1-pid11")
    incident.write(first, str(tmp_path))
    assert not (tmp_path / "index.html").exists()  # one report: no index
    peer = {"rank": 1, "host": "h", "pid": 11, "error": "NonFiniteOutputError: ...", "report": "x"}
    from cublas_guard_ext.run.runtime import PeerFailedError

    second = incident.facts(PeerFailedError(failed_rank=1, failed_report="x"), None, peer=peer)
    second.update(rank=0, stem="h-rank0-pid10")
    incident.write(second, str(tmp_path))
    index = (tmp_path / "index.html").read_text()
    assert index.index("h-rank1-pid11.html") < index.index("h-rank0-pid10.html")
    assert "2 incident reports" in index


def test_an_unwritable_folder_is_a_reason_not_an_exception(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    path, problem = incident.write(incident.facts(KeyError("x"), None), str(blocker / "reports"))
    assert path is None and problem.startswith(("FileExistsError", "NotADirectoryError"))


def test_commands_follow_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = options.parse(["--mode", "async", "train.py", "--lr", "3"])
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    plain = [c["command"] for c in incident.next_commands(opts, "cuda", "/r/c.pt", False)]
    assert plain == [
        "python -m cublas_guard_ext replay /r/c.pt",
        "python -m cublas_guard_ext doctor --capsule /r/c.pt",
        "PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer python train.py --lr 3",
        "CUDA_LAUNCH_BLOCKING=1 python -m cublas_guard_ext run --mode async train.py --lr 3",
        "python -m cublas_guard_ext doctor",
    ]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "8")
    launched = [c["command"] for c in incident.next_commands(opts, "cuda", None, False)]
    assert launched[0] == (
        "PYTORCH_NO_CUDA_MEMORY_CACHING=1 torchrun --nproc-per-node=4 --nnodes=2 --no-python "
        "compute-sanitizer python train.py --lr 3"
    )
    assert launched[1] == (
        "CUDA_LAUNCH_BLOCKING=1 torchrun --nproc-per-node=4 --nnodes=2 -m cublas_guard_ext run --mode async "
        "train.py --lr 3"
    )
    nan = [c["command"] for c in incident.next_commands(opts, "nonfinite", None, unattributed=True)]
    assert nan == [
        "torchrun --nproc-per-node=4 --nnodes=2 -m cublas_guard_ext run --mode async --watch train.py --lr 3"
    ]


def test_a_cublas_report_shows_the_call_the_capsule_and_the_doctor(tmp_path: Path) -> None:
    err = cg.CublasError(
        layer="encoder.0",
        status=13,
        api="cublasSgemm",
        purpose="forward",
        transa="T",
        transb="N",
        m=16,
        n=3,
        k=8,
        lda=8,
        ldb=8,
        ldc=16,
        data_type="CUDA_R_32F",
    )
    err.capsule = str(tmp_path / "c.cgcapsule.pt")
    data = incident.facts(err, options.parse(["train.py"]), root=Net())
    call = data["cublas_call"]
    assert call["status_name"] == "CUBLAS_STATUS_EXECUTION_FAILED" and (call["m"], call["n"], call["k"]) == (
        16,
        3,
        8,
    )
    assert data["where"]["module"] == "encoder.0" and data["doctor"]["summary"] is not None
    page = report_html.render(data)
    assert f"python -m cublas_guard_ext replay {err.capsule}" in page and "CUDA_R_32F" in page


def test_the_report_escapes_what_it_shows() -> None:
    data = incident.facts(ValueError("<script>alert(1)</script>"), None)
    page = report_html.render(data)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


@pytest.fixture(autouse=True)
def _no_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def test_torchs_own_cuda_error_gets_the_cuda_commands_and_the_doctor() -> None:
    """A CUDA error of an op outside the guard (torch's RuntimeError): the sanitizer and
    CUDA_LAUNCH_BLOCKING commands, the doctor, and --watch to name the op."""
    err = RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")
    data = incident.facts(err, options.parse(["train.py"]))
    commands = [c["command"] for c in data["next_commands"]]
    assert commands == [
        "PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer python train.py",
        "CUDA_LAUNCH_BLOCKING=1 python -m cublas_guard_ext run train.py",
        "python -m cublas_guard_ext run --watch train.py",
        "python -m cublas_guard_ext doctor",
    ]
    assert data["doctor"]["summary"] is not None and data["cublas_call"] is None
    assert incident.facts(RuntimeError("shapes cannot be multiplied"), None)["doctor"] is None


def test_a_parameter_non_finite_on_entry_marks_its_module() -> None:
    err = cg.NonFiniteEntryError(
        role="parameter",
        name="blocks.1.mlp.up.weight",
        nan_count=2,
        posinf_count=0,
        neginf_count=0,
        first_bad_index=3,
        shape=[8, 8],
        dtype="torch.float32",
    )
    data = incident.facts(err, options.parse(["train.py"]), root=Net())
    assert data["where"]["module"] == "blocks.1.mlp.up" and data["statistics"]["nan_count"] == 2
    marked = [n["name"] for n in data["module_tree"]["nodes"] if n["birth"]]
    assert marked == ["blocks.1.mlp.up"]
    assert [c["command"] for c in data["next_commands"]] == [
        "python -m cublas_guard_ext run --watch train.py"
    ]


def test_a_silent_corruption_verdict_reaches_the_json_and_the_page(tmp_path: Path) -> None:
    err = cg.SilentCorruptionError(
        verdict="persistent",
        step=12,
        rank=1,
        ranks=[1],
        world_size=2,
        host="node-7",
        device="cuda:1",
        gpu_uuid="GPU-1234",
        module="embed",
        phase="forward",
        what="output",
        gemm="forward GEMM (input x weight^T + bias), in Linear",
        trigger="a checked step (every 50 steps)",
        comparison="bitwise",
        replays=[
            {"rank": 0, "host": "node-1", "device": "cuda:0", "signature": 11},
            {"rank": 1, "host": "node-7", "device": "cuda:1", "signature": 12},
        ],
        exit_code=16,
    )
    data = incident.facts(err, options.parse(["train.py"]), step=12, root=Net())
    assert data["verdict"] == {
        "verdict": "persistent",
        "step": 12,
        "rank": 1,
        "ranks": [1],
        "host": "node-7",
        "device": "cuda:1",
        "gpu_uuid": "GPU-1234",
        "where": {
            "module": "embed",
            "phase": "forward",
            "what": "output",
            "gemm": "forward GEMM (input x weight^T + bias), in Linear",
        },
        "trigger": "a checked step (every 50 steps)",
        "comparison": "bitwise",
        "replays": err.fields["replays"],
        "exit_code": 16,
        "capsule": None,
    }
    assert data["where"]["module"] == "embed"
    page, problem = incident.write(data, str(tmp_path))
    assert problem is None
    html = page.read_text()
    assert '<section id="verdict"><h2>The rerun verdict</h2>' in html
    assert 'data-field="gemm">forward GEMM (input x weight^T + bias)' in html
    assert "GPU-1234" in html and "node-7" in html
    assert json.loads(page.with_suffix(".json").read_text())["verdict"]["verdict"] == "persistent"


def test_a_non_finite_steps_replay_is_a_verdict_too() -> None:
    reproducible = cg.NonFiniteStepError(
        step=3, classification="persistent", op="aten.log.default", module="act"
    )
    transient = cg.NonFiniteStepError(step=3, classification="transient")
    assert incident.facts(reproducible, None)["verdict"]["verdict"] == "reproducible"
    assert incident.facts(reproducible, None)["verdict"]["where"] == {
        "module": "act",
        "op": "aten.log.default",
    }
    assert incident.facts(transient, None)["verdict"]["verdict"] == "transient"
    assert incident.facts(cg.NonFiniteOutputError(op="aten.mm.default"), None)["verdict"] is None
