"""TrainingGuard(skip_list=PATH): a reproducible bad step appends its culprits; a later batch
holding one is skipped before its closure; a run resumed from an earlier checkpoint with the
list follows the original trajectory bit for bit; bad files and paths; concurrent writers;
guard.state_dict()."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.errors.samples import SkipListError
from cublas_guard_ext.training.skip_list import SkipList

BAD_ID, BAD_STEP = 42, 4  # sample 42 is row 2 of step 4's batch


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
    ids = [10 * step + r for r in range(6)]
    if BAD_ID in ids:
        x[ids.index(BAD_ID), 3] = float("nan")  # the corrupt sample
    return x, y, ids


def train(model, opt, guard, steps, calls: list[int] | None = None):
    for step in steps:
        x, y, ids = batch(step)

        def closure(x=x, y=y, step=step):
            if calls is not None:
                calls.append(step)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        guard.step(closure, sample_ids=ids)


def checkpoint(model, opt, guard) -> dict:
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "guard": guard.state_dict(),
            "rng": torch.get_rng_state(),
        }
    )


def lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_a_reproducible_bad_step_lists_its_culprit_and_a_resume_matches_bit_for_bit(tmp_path):
    path = tmp_path / "skip.jsonl"
    model, opt = make()
    guard = cg.TrainingGuard(model, opt, on_nan="skip", skip_list=path)
    torch.manual_seed(5)
    train(model, opt, guard, range(1, 3))
    saved = checkpoint(model, opt, guard)
    with pytest.warns(RuntimeWarning, match=f"samples: {BAD_ID} "):
        train(model, opt, guard, range(3, 9))
    (entry,) = lines(path)
    assert entry["sample_id"] == BAD_ID and entry["step"] == BAD_STEP and entry["verdict"] == "persistent"
    assert entry["rank"] is None and entry["reason"] == "non_finite" and "argument" in entry["where"]
    assert entry["time"].endswith("+00:00")
    original = [p.detach().clone() for p in model.parameters()]

    # resume from step 2's checkpoint: on_nan="raise", so the corrupt batch must never run
    model2, opt2 = make()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    guard2 = cg.TrainingGuard(model2, opt2, on_nan="raise", skip_list=path)
    guard2.load_state_dict(saved["guard"])
    torch.set_rng_state(saved["rng"])
    calls: list[int] = []
    with pytest.warns(
        RuntimeWarning,
        match=rf"training step {BAD_STEP}: skipped before its closure ran: it holds listed sample {BAD_ID}",
    ):
        train(model2, opt2, guard2, range(3, 9), calls)
    assert BAD_STEP not in calls and calls == [3, 5, 6, 7, 8]
    assert guard2.steps == guard.steps == 8 and guard2.list_skips == 1 and guard2.stepped is not False
    for p, q in zip(original, model2.parameters()):
        assert torch.equal(p, q)
    assert len(lines(path)) == 1  # nothing appended twice


def test_a_transient_bad_step_lists_nothing(tmp_path):
    path = tmp_path / "skip.jsonl"
    model, opt = make()
    guard = cg.TrainingGuard(model, opt, on_nan="skip", skip_list=path)
    x, y, ids = batch(1)
    x[0, 0] = float("nan")
    shots = [0]

    def closure():
        opt.zero_grad()
        xx = x if shots[0] == 0 else torch.nan_to_num(x)  # the replay sees a clean batch
        shots[0] += 1
        loss = F.mse_loss(model(xx), y)
        loss.backward()
        return loss

    with pytest.warns(RuntimeWarning, match="transient"):
        guard.step(closure, sample_ids=ids)
    assert path.read_text() == "" and not guard.skip_list.ids


def test_the_whole_batch_is_not_listed_when_the_culprit_cannot_be_told_apart(tmp_path):
    path = tmp_path / "skip.jsonl"
    model, opt = make()
    guard = cg.TrainingGuard(model, opt, on_nan="skip", skip_list=path)
    x, y, ids = batch(1)
    x[:, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"skip list: not added to .* \(no culprit told apart"):
        guard.step(lambda: F.mse_loss(model(x), y).backward(), sample_ids=ids)
    assert path.read_text() == ""


# -- the file --------------------------------------------------------------------------------


def test_a_torn_last_line_is_ignored_with_a_warning_and_the_rest_kept(tmp_path):
    path = tmp_path / "skip.jsonl"
    path.write_text(
        '{"sample_id": 7, "step": 1}\nnot json\n{"sample_id": 9, "step": 2}\n{"sample_id": 11, "st'
    )
    with pytest.warns(RuntimeWarning) as seen:
        skip = SkipList(path)
    text = str(seen[0].message)
    assert f"skip list {path}: ignored 2 lines that could not be read (line 2: not JSON" in text
    assert "line 4: 21 bytes without a newline (a write cut short)" in text
    assert skip.ids == {7, 9}
    skip.append([13], step=5, verdict="persistent", where="w", rank=None, reason="non_finite")
    raw = path.read_text().splitlines()
    assert raw[3] == '{"sample_id": 11, "st' and json.loads(raw[4])["sample_id"] == 13  # its own line
    with pytest.warns(RuntimeWarning, match="ignored 2 lines"):
        assert SkipList(path).ids == {7, 9, 13}


@pytest.mark.skipif(not hasattr(os, "pread"), reason="POSIX file locks")
def test_a_line_still_being_written_by_another_rank_is_not_taken_for_torn(tmp_path):
    # Another rank holds the append lock with half its line on disk: opening the list waits
    # for the whole line instead of warning of a torn one and writing a blank line later.
    import fcntl
    import threading

    path = tmp_path / "skip.jsonl"
    path.write_text('{"sample_id": 7, "step": 1}\n')
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b'{"sample_id": 8, "st')
    opened: list[SkipList] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reader = threading.Thread(target=lambda: opened.append(SkipList(path)))
        reader.start()
        reader.join(0.2)
        assert reader.is_alive()  # waiting on the writer's lock, not reading half a line
        os.write(fd, b'ep": 2}\n')
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        reader.join(10)
    assert opened[0].ids == {7, 8}
    opened[0].append([9], step=3, verdict="persistent", where=None, rank=None, reason="non_finite")
    assert [e["sample_id"] for e in lines(path)] == [7, 8, 9]  # no blank line in between


def test_a_line_without_an_integer_id_is_ignored(tmp_path):
    path = tmp_path / "skip.jsonl"
    path.write_text('{"sample_id": "a"}\n[1]\n{"sample_id": 3}\n')
    with pytest.warns(
        RuntimeWarning, match=r"line 1: no integer sample_id \(got 'a'\); line 2: not a JSON object"
    ):
        assert SkipList(path).ids == {3}


def test_paths_that_cannot_be_used_are_refused_at_construction(tmp_path):
    model, opt = make()
    with pytest.raises(SkipListError, match=rf"the skip list {tmp_path} is a directory, not a file"):
        cg.TrainingGuard(model, opt, skip_list=tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(
        SkipListError,
        match=rf"the skip list {blocker}/skip.jsonl cannot be appended to \(File exists: {blocker}\)",
    ):
        cg.TrainingGuard(model, opt, skip_list=blocker / "skip.jsonl")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes any file")
def test_unreadable_and_unwritable_files_are_refused(tmp_path):
    model, opt = make()
    path = tmp_path / "skip.jsonl"
    path.write_text("")
    path.chmod(0o200)
    with pytest.raises(SkipListError, match="cannot be read"):
        cg.TrainingGuard(model, opt, skip_list=path)
    path.chmod(0o400)
    with pytest.raises(SkipListError, match="cannot be appended to"):
        cg.TrainingGuard(model, opt, skip_list=path)


_WRITER = """
import sys
from cublas_guard_ext.training.skip_list import SkipList
path, start, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
skip = SkipList(path)
for i in range(start, start + count):
    skip.append([i], step=i, verdict="persistent", where="x" * 300, rank=start, reason="non_finite")
"""


def test_two_processes_appending_write_whole_lines(tmp_path):
    # Fresh interpreters, not fork: a forked child of an xdist worker can inherit a lock another
    # thread held (execnet's I/O thread, a stream's) and hang before it writes a line.
    path = str(tmp_path / "skip.jsonl")
    SkipList(path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, path, str(start), "400"], stderr=subprocess.PIPE, text=True
        )
        for start in (0, 10_000)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    entries = lines(path)  # every line parses: none was interleaved with another
    assert sorted(e["sample_id"] for e in entries) == list(range(400)) + list(range(10_000, 10_400))


# -- the guard's state -------------------------------------------------------------------------


def _spike_run(mode: str) -> tuple[list, dict]:
    """Six ordinary steps, then a spike; "resumed"/"fresh": a new guard before the spike,
    given the old one's state_dict or not."""

    def guard_for(model, opt):
        checks = cg.SilentCorruptionChecks(spike_threshold=6.0, spike_min_history=4, spike_window=8)
        return cg.TrainingGuard(model, opt, silent_corruption=checks)

    def closure_for(model, opt, step, scale=1.0):
        x, y, _ = batch(step)

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(torch.nan_to_num(x)), y * scale)
            loss.backward()
            return loss

        return closure

    model, opt = make()
    guard = guard_for(model, opt)
    for step in range(1, 7):
        guard.step(closure_for(model, opt, step))
    state = guard.state_dict()
    if mode != "original":
        guard = guard_for(model, opt)
        if mode == "resumed":
            guard.load_state_dict(copy.deepcopy(state))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard.step(closure_for(model, opt, 7, scale=100.0))
    verdicts = [(v["verdict"], v["step"]) for v in guard.silent_corruption.verdicts]
    return verdicts, guard.state_dict()


def test_state_dict_lets_a_resumed_run_judge_spikes_as_the_original():
    original, state = _spike_run("original")
    assert original == [("reproducible", 7)], original
    resumed, resumed_state = _spike_run("resumed")
    assert resumed == original
    assert _spike_run("fresh")[0] == []  # without the state: too little history to judge
    assert resumed_state["steps"] == state["steps"] == 7
    assert resumed_state == state  # the spike window (float32 values through JSON) bit for bit


def test_state_dict_round_trips_through_torch_distributed_checkpoint(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    _, state = _spike_run("original")
    model, opt = make()
    checks = cg.SilentCorruptionChecks(spike_threshold=6.0, spike_min_history=4, spike_window=8)
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
    guard.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (DCP without a process group says so)
        dcp.save({"guard": guard}, checkpoint_id=tmp_path / "dcp")
        fresh = cg.TrainingGuard(
            model,
            opt,
            silent_corruption=cg.SilentCorruptionChecks(
                spike_threshold=6.0, spike_min_history=4, spike_window=8
            ),
        )
        dcp.load({"guard": fresh}, checkpoint_id=tmp_path / "dcp")
    assert fresh.state_dict() == state


def test_load_state_dict_refuses_a_foreign_state():
    model, opt = make()
    guard = cg.TrainingGuard(model, opt)
    with pytest.raises(
        ValueError,
        match=r"expected a TrainingGuard state \(version 1\) from guard.state_dict\(\), got version None",
    ):
        guard.load_state_dict({"steps": 3})


# -- spikes name their samples -----------------------------------------------------------------


def _spiking_run(tmp_path, per_sample: bool, on_spike: str = "skip"):
    """Six ordinary steps, then step 7 whose row 3 has a target 1000x too large."""
    model, opt = make()
    checks = cg.SilentCorruptionChecks(
        spike_threshold=6.0, spike_min_history=4, spike_window=8, on_spike=on_spike
    )
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks, skip_list=tmp_path / "skip.jsonl")
    for step in range(1, 8):
        x, y, ids = batch(step)
        x = torch.nan_to_num(x)
        if step == 7:
            y = y.clone()
            y[3] = 1e3

        def closure(x=x, y=y):
            opt.zero_grad()
            losses = F.mse_loss(model(x), y, reduction="none").mean(dim=1)
            losses.mean().backward()
            return losses if per_sample else losses.mean()

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = guard.step(closure, sample_ids=ids)
        if step < 7:
            assert out is not None and out.dim() == 0  # per-sample losses come back as their mean
    return checks, [str(w.message) for w in seen], tmp_path / "skip.jsonl"


def test_a_spike_names_the_sample_whose_loss_stands_out_and_skip_lists_it(tmp_path):
    checks, seen, path = _spiking_run(tmp_path, per_sample=True)
    (verdict,) = checks.verdicts
    assert verdict["verdict"] == "reproducible" and verdict["samples"]["ids"] == [73]
    assert (
        "samples: 73 (per-sample loss" in seen[0] and "a robust z-score within the batch above 6" in seen[0]
    )
    assert f"skip list: 1 sample appended to {path}" in seen[0]
    (entry,) = lines(path)
    assert entry["sample_id"] == 73 and entry["reason"] == "spike" and entry["verdict"] == "reproducible"


def test_a_spike_without_per_sample_losses_names_the_batch(tmp_path):
    checks, seen, path = _spiking_run(tmp_path, per_sample=False)
    assert checks.verdicts[0]["samples"]["ids"] == []
    assert "samples: the whole batch (the closure returned one loss for the batch" in seen[0]
    assert path.read_text() == ""


def test_an_applied_spike_names_its_samples_but_lists_nothing(tmp_path):
    checks, _, path = _spiking_run(tmp_path, per_sample=True, on_spike="apply")
    assert checks.verdicts[0]["samples"]["ids"] == [73] and path.read_text() == ""
