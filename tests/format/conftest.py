"""Fixtures of the format tests."""

from __future__ import annotations

import pytest

from tiersave.format import compact


@pytest.fixture
def compact_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every manifest written in the compact encoding (formats 4.x and 5.x), however few its tensors."""
    monkeypatch.setattr(compact, "COMPACT_MIN_TENSORS", 1)
