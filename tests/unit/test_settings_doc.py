"""The README's settings table lists every setting a user sets, and only those."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from dispatcher.conf import DEPRECATED, DispatcherSettings, Setting, dispatcher_settings

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_table_lists_exactly_the_settings():
    table = set(re.findall(r"^\| `DISPATCHER_(\w+)` \|", README.read_text(), flags=re.M))
    settings = {name for name, value in vars(DispatcherSettings).items() if isinstance(value, Setting)}
    assert table == settings
    assert len(settings) <= 25


def test_a_deprecated_setting_still_applies_for_one_release_and_says_so(settings):
    settings.DISPATCHER_DISPENSE_BATCH = "7"
    with pytest.warns(DeprecationWarning, match="DISPATCHER_DISPENSE_BATCH is deprecated.*dispenser.DISPENSE_BATCH"):
        assert dispatcher_settings.tuned("DISPENSE_BATCH", 500) == 7
    assert set(DEPRECATED) <= set(re.findall(r"`DISPATCHER_(\w+)`", README.read_text()))


def test_an_internal_constant_applies_when_no_deprecated_setting_is_set():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatcher_settings.tuned("RESCUE_BATCH", 200) == 200
