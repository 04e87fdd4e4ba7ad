"""Python's switch interval, as the MLX thread sets it."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from mlxq.engine import gil


@pytest.fixture(autouse=True)
def restore() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_lowers_the_default_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gil.ENV, raising=False)
    sys.setswitchinterval(0.005)
    assert gil.shorten_switch_interval() == pytest.approx(0.0005)
    sys.setswitchinterval(0.0001)  # already shorter: kept
    assert gil.shorten_switch_interval() == pytest.approx(0.0001)


def test_the_environment_sets_it_or_leaves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.setswitchinterval(0.005)
    monkeypatch.setenv(gil.ENV, "0")
    assert gil.shorten_switch_interval() == pytest.approx(0.005)
    monkeypatch.setenv(gil.ENV, "1")
    assert gil.shorten_switch_interval() == pytest.approx(0.001)


@pytest.mark.parametrize("value", ["fast", "-1"])
def test_a_bad_value_says_what_to_give(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(gil.ENV, value)
    with pytest.raises(ValueError, match="MLXQ_SWITCH_INTERVAL_MS"):
        gil.shorten_switch_interval()
