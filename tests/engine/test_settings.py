"""Numbers read from the environment: defaults, and errors that name the variable."""

from __future__ import annotations

import pytest

from mlxq.engine.settings import number, whole_number
from mlxq.engine.slots import choices
from mlxq.engine.slots.choices import DecodeChoices
from mlxq.wire import ModelInfo

NAME = "MLXQ_TEST_SETTING"


def test_whole_numbers(monkeypatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert whole_number(NAME, 7) == 7
    monkeypatch.setenv(NAME, " 12 ")
    assert whole_number(NAME, 7, 1) == 12
    for bad, least in (("0", 1), ("-3", 0), ("2.5", 0), ("many", 0), ("", 0)):
        monkeypatch.setenv(NAME, bad)
        want = rf"{NAME}='{bad}': give a whole number of rows, {least} or more"
        with pytest.raises(ValueError, match=want):
            whole_number(NAME, 7, least, " of rows")


def test_numbers(monkeypatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert number(NAME, 0.5) == 0.5
    monkeypatch.setenv(NAME, "1.25")
    assert number(NAME, 0.5) == 1.25
    for bad in ("-0.1", "nan", "soon", ""):
        monkeypatch.setenv(NAME, bad)
        with pytest.raises(ValueError, match=rf"{NAME}='{bad}': give a number, 0 or more"):
            number(NAME, 0.5)


@pytest.mark.parametrize(
    ("env", "bad"),
    [(choices.JOIN_ENV, "four"), (choices.JOIN_COST_ENV, "-1"), (choices.SPLIT_ENV, "1MB")],
)
def test_the_slot_engine_refuses_a_mistyped_setting(monkeypatch, env: str, bad: str) -> None:
    """The join and split settings were read with a bare ``int()`` (whose message names no
    variable) and took negative values; now each names itself and what to give."""
    info = ModelInfo("t", "llama", 2, 64, 2, 8, 512, 1024, 2 * 2 * 2 * 8 * 4, 1 << 20, "float32")
    monkeypatch.setenv(env, bad)
    with pytest.raises(ValueError, match=rf"{env}='{bad}': give a (whole )?number"):
        DecodeChoices.choose("cpu", info, None, None)
