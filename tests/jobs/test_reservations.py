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


def test_windows_stop_where_the_job_they_are_for_ended():
    """A job's reservation holds nothing once its job has ended (the planner's snapshot leaves it
    out), so the Cluster page's timeline draws no window past that: found 2026-12-07 in the demo,
    where omni-7b had completed and its reservation's windows still ran on to the chart's edge."""
    from jobs.live_data import reservation_windows
    from jobs.models import Job, JobState

    job = Job(pk=1, name="crit", state=JobState.RUNNING)
    r = _res(period_s=1800, active_s=600, job=job)
    day = (T0, T0 + timedelta(hours=6))
    assert len(reservation_windows(r, *day)) == 12 and r.over_at is None
    job.state, job.finished_at = JobState.COMPLETED, T0 + timedelta(hours=1, minutes=5)
    assert r.job_ended_at == r.over_at == job.finished_at
    # The windows at 0:00 and 0:30, and the one the job ended in, cut at its end; none after.
    assert reservation_windows(r, *day) == [(T0, T0 + timedelta(minutes=10)),
                                           (T0 + timedelta(minutes=30), T0 + timedelta(minutes=40)),
                                           (T0 + timedelta(hours=1), job.finished_at)]
    # Nor is it active, or a window next, once its job has ended.
    assert r.is_active_at(T0 + timedelta(hours=1, minutes=4))
    assert not r.is_active_at(T0 + timedelta(hours=1, minutes=6))
    assert r.next_window_start(T0 + timedelta(minutes=50)) == T0 + timedelta(hours=1)
    assert r.next_window_start(T0 + timedelta(hours=1, minutes=6)) is None
    # A cancellation before the end counts first.
    r.cancelled_at = T0 + timedelta(minutes=35)
    assert r.over_at == r.cancelled_at and reservation_windows(r, *day)[-1][1] == r.cancelled_at
