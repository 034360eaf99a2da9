"""The fake partner serves in a thread of the test: while it does, the heap the test process
already holds is kept out of full collections, which would stall the partner's thread and make
it stamp the requests that waited as arrivals bunched together (``support.fakeapi``)."""
from __future__ import annotations

import gc

from support.fakeapi import FakeAPI


def test_a_partner_keeps_the_heap_it_found_frozen_until_the_last_partner_stops():
    before = gc.get_freeze_count()
    first = FakeAPI().start()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > before
        second = FakeAPI().start()
        second.stop()
        assert gc.get_freeze_count() >= frozen  # the first still serves: still frozen
    finally:
        first.stop()
    assert gc.get_freeze_count() == 0
