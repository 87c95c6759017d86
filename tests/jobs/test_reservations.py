"""Reservation windows: absolute and recurring, is_active_at and next_window_start."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from jobs.models import Reservation

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _res(**kw) -> Reservation:
    return Reservation(name="r", gpus=8, start_at=T0, **kw)


def test_absolute_reservation_is_active_inside_its_span_only():
    r = _res(end_at=T0 + timedelta(hours=2))
    assert not r.is_active_at(T0 - timedelta(seconds=1))
    assert r.is_active_at(T0)
    assert r.is_active_at(T0 + timedelta(hours=1))
    assert not r.is_active_at(T0 + timedelta(hours=2))


def test_recurring_reservation_is_active_40_of_every_60_minutes():
    r = _res(period_s=3600, active_s=2400)
    assert r.is_active_at(T0 + timedelta(minutes=39, seconds=59))
    assert not r.is_active_at(T0 + timedelta(minutes=40))
    assert not r.is_active_at(T0 + timedelta(minutes=59))
    assert r.is_active_at(T0 + timedelta(hours=5, minutes=1))


def test_next_window_start_of_a_recurring_reservation():
    r = _res(period_s=3600, active_s=2400)
    assert r.next_window_start(T0 - timedelta(hours=1)) == T0
    assert r.next_window_start(T0) == T0
    assert r.next_window_start(T0 + timedelta(minutes=41)) == T0 + timedelta(hours=1)
    assert r.window_end(T0 + timedelta(hours=1)) == T0 + timedelta(hours=1, minutes=40)


def test_no_next_window_after_the_end_or_for_a_started_absolute_one():
    r = _res(end_at=T0 + timedelta(hours=2), period_s=3600, active_s=600)
    assert r.next_window_start(T0 + timedelta(minutes=61)) is None
    assert _res().next_window_start(T0 + timedelta(minutes=1)) is None


def test_cancelled_reservation_is_never_active_afterwards():
    r = _res(cancelled_at=T0 + timedelta(minutes=5))
    assert r.is_active_at(T0 + timedelta(minutes=4))
    assert not r.is_active_at(T0 + timedelta(minutes=5))
    assert r.next_window_start(T0 + timedelta(minutes=6)) is None
