"""Messages that explain: weights never loaded (meta tensors) say so and how to load them;
replay and doctor --capsule on a file that is no capsule, or that would run code when
loaded, print one line, exit non-zero, and run nothing."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext import capsule

# -- meta tensors ------------------------------------------------------------------------------


def test_weights_never_loaded_say_so_and_how_to_load_them():
    with torch.device("meta"):  # what accelerate's init_empty_weights does to parameters
        model = nn.Sequential(nn.Linear(4, 3))
    cg.replace_linear(model)
    with pytest.raises(cg.DeviceMismatchError) as info:
        model(torch.randn(2, 4))
    err = info.value
    assert isinstance(err, RuntimeError) and err.weight_device == "meta"
    text = str(err)
    assert text.startswith("layer '0': its weight is on the meta device (a shape, no values): ")
    assert "weights were never loaded" in text and "load_state_dict(state_dict, assign=True)" in text
    assert "to_empty(device='cpu')" in text
    assert "model.to('cpu')" not in text and "x.to('meta')" not in text


def test_accelerate_init_empty_weights_gives_the_same_message():
    accelerate = pytest.importorskip("accelerate")
    with accelerate.init_empty_weights():
        model = cg.replace_linear(nn.Sequential(nn.Linear(4, 3)))
    with pytest.raises(cg.DeviceMismatchError, match="weights were never loaded"):
        model(torch.randn(2, 4))


def test_a_meta_input_is_named_as_such():
    layer = cg.SafeLinear(4, 3, name="l")
    with pytest.raises(cg.DeviceMismatchError) as info:
        layer(torch.randn(2, 4, device="meta"))
    text = str(info.value)
    assert "input is on meta" in text and "a meta tensor (no values)" in text
    assert "model.to('meta')" not in text


def test_an_ordinary_device_mismatch_keeps_its_advice():
    err = cg.DeviceMismatchError(
        layer="l", role="input", anchor="weight", input_device="cuda:0", weight_device="cpu", shape=[2, 4]
    )
    assert "move the input: x = x.to('cpu')" in str(err) and "model.to('cuda:0')" in str(err)


# -- files that are no capsule ------------------------------------------------------------------


class RunsCode:
    """Pickles as a call of os.system: loading it with pickle would create ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def foreign_files(tmp_path):
    marker = tmp_path / "ran"
    evil_raw = tmp_path / "evil.pt"
    evil_raw.write_bytes(pickle.dumps(RunsCode(str(marker))))
    evil_old = tmp_path / "evil2.pt"
    evil_old.write_bytes(pickle.dumps(RunsCode(str(marker)), protocol=2))
    evil_zip = tmp_path / "evil3.pt"
    torch.save({"format": capsule.FORMAT, "x": RunsCode(str(marker))}, evil_zip)  # torch's own format
    noise = tmp_path / "noise.pt"
    # Seeded: os.urandom's bytes were now and then read as a pickle naming a global, refused as
    # code (also a right answer, but not the not-a-capsule path this file is here for).
    noise.write_bytes(random.Random(4096).randbytes(4096))
    plain = tmp_path / "plain.pt"
    torch.save({"a": torch.ones(2)}, plain)  # loads, but is no capsule
    return marker, {"evil": [evil_raw, evil_old, evil_zip], "not": [noise, plain]}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cublas_guard_ext", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_replay_and_doctor_refuse_foreign_files_in_one_line_and_run_nothing(foreign_files):
    marker, files = foreign_files
    for kind, paths in files.items():
        for path in paths[:1]:  # (each kind through capsule.load below; a CLI call costs an import)
            for args in (("replay", str(path)), ("doctor", "--no-probe", "--capsule", str(path))):
                done = cli(*args)
                lines = (done.stdout + done.stderr).strip().splitlines()
                assert done.returncode != 0 and len(lines) == 1, (args, lines)
                expected = (
                    "refused: this file would run code when loaded" if kind == "evil" else "not a capsule"
                )
                assert lines[0].endswith(expected) or expected + " (it names" in lines[0], lines[0]
                assert str(path) in lines[0] and "weights_only" not in lines[0]
    assert not marker.exists()


def test_load_raises_one_typed_error_and_replay_the_same(foreign_files, tmp_path):
    marker, files = foreign_files
    for path in files["evil"]:
        with pytest.raises(capsule.CapsuleFileError) as info:
            capsule.load(path)
        assert isinstance(info.value, ValueError) and info.value.reason.startswith(capsule.REFUSED_CODE)
        assert "posix.system" in str(info.value) or "os.system" in str(info.value)
    for path in files["not"]:
        with pytest.raises(capsule.CapsuleFileError, match="not a capsule$"):
            capsule.load(path)
    with pytest.raises(capsule.CapsuleFileError, match="not a capsule$"):
        cg.replay(files["not"][0])
    with pytest.raises(capsule.CapsuleFileError, match="No such file"):
        capsule.load(tmp_path / "missing.pt")
    assert not marker.exists()
