"""gc_paused: the collector is off inside, back on after the last holder -
also when holders nest or overlap in threads, and after an exception."""

from __future__ import annotations

import gc
import threading

import pytest

from healthgate.gcpause import gc_paused


def test_paused_inside_and_back_after_the_last_holder() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # (the outer one still holds it)
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_overlapping_threads_leave_it_on_and_a_disabled_one_off() -> None:
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(10)
    with gc_paused():
        pass
    assert not gc.isenabled()  # the thread still holds it
    release.set()
    t.join(10)
    assert gc.isenabled()
    gc.disable()  # (someone turned it off on purpose: it stays off)
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
