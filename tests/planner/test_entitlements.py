"""Rule 2: which GPUs each reservation guarantees, and when."""

from __future__ import annotations

import math

from jobs.planner import Reservation
from jobs.planner.entitlements import entitled_gpus, is_active, next_start_s, pool_size, window_end_s


def test_absolute_reservation_is_active_from_start_to_end() -> None:
    res = Reservation("r", "job", gpus=32, start_s=1000.0, end_s=5000.0)
    assert not is_active(res, 999.0)
    assert is_active(res, 1000.0) and is_active(res, 4999.0)
    assert not is_active(res, 5000.0)


def test_recurring_window_is_active_40_of_every_60_minutes() -> None:
    res = Reservation("r", "job", gpus=32, start_s=0.0, period_s=3600.0, active_s=2400.0)
    assert is_active(res, 0.0) and is_active(res, 2399.0)
    assert not is_active(res, 2400.0) and not is_active(res, 3599.0)
    assert is_active(res, 3600.0)
    assert window_end_s(res, 100.0) == 2400.0


def test_next_start_of_a_recurring_window_is_the_next_period() -> None:
    res = Reservation("r", "job", gpus=32, start_s=100.0, period_s=3600.0, active_s=2400.0)
    assert next_start_s(res, 0.0) == 100.0
    assert next_start_s(res, 2600.0) == 3700.0
    once = Reservation("r", "job", gpus=32, start_s=100.0)
    assert next_start_s(once, 200.0) == math.inf


def test_times_need_not_start_at_zero() -> None:
    epoch = 1_764_460_800.0  # production uses Unix seconds
    res = Reservation("r", "job", gpus=8, start_s=epoch, period_s=3600.0, active_s=2400.0)
    assert is_active(res, epoch + 3600.0 * 24 + 10)
    assert not is_active(res, epoch + 3600.0 * 24 + 2500)


def test_no_entitlement_while_the_job_is_not_runnable() -> None:
    res = Reservation("r", "job", gpus=32)
    assert entitled_gpus(res, 10.0, job_runnable=False) == 0
    assert entitled_gpus(res, 10.0, job_runnable=True) == 32
    assert entitled_gpus(res, 10.0, job_runnable=True, job_max_gpus=16) == 16


def test_pool_holds_guaranteed_gpus_plus_spares() -> None:
    assert pool_size(Reservation("r", "job", gpus=32, spares=8)) == 40
