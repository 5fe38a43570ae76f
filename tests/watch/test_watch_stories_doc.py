"""docs/nan-stories.md's issue-47 stories show the messages word for word: each is rebuilt here
from the same scenario as its test and compared with the doc's code block (the born-at stack,
which names this machine's paths, cut)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_watch_cache import CachedAttn
from test_watch_masks import B, D, Model, T, _mask
from test_watch_optimizer import Tiny, _step

import cublas_guard_ext as cg

DOC = Path(__file__).resolve().parents[2] / "docs" / "nan-stories.md"


def _block(title: str) -> str:
    text = DOC.read_text()
    section = text.split(f"## {title}\n", 1)[1]
    return re.search(r"```\n(.*?)\n```", section, re.S).group(1)


def _message(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).split(chr(10) + '  born at')[0]}"


def _optimizer() -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=5.0)
    _step(model, opt, 1.0)
    with cg.watch(model, mode="sync"):
        _step(model, opt, 1e21)


def _masks() -> None:
    torch.manual_seed(0)
    model = Model()
    with cg.watch(model, mode="sync"):
        model(torch.randn(B, T, D), _mask("left"))


def _cache() -> None:
    torch.manual_seed(0)
    model = CachedAttn().eval()
    with torch.no_grad():
        model(torch.randn(1, 4, 16), 0)
        with cg.watch(model, mode="sync"):
            model(torch.randn(1, 1, 16), 4)


@pytest.mark.parametrize(
    "title, scenario",
    [
        ("Divergence in the optimizer", _optimizer),
        ("A query with every key masked", _masks),
        ("NaN in a cache's unused positions", _cache),
    ],
)
def test_the_doc_shows_the_message_word_for_word(title, scenario):
    with pytest.raises(cg.GuardError) as info:
        scenario()
    assert _message(info.value) == _block(title)
