"""Receiving from the channel layer in synchronous tests, with a bound.

A plain ``async_to_sync(layer.receive)(channel)`` waits for ever. CI once hung on one for 25
minutes (``test_live_message_follows_commit_with_the_new_points_and_is_throttled``, whose held
batch the throttle's timer thread sent after reading allocations from the database). The batch
had gone out (``group_send`` returned), but the receive never returned. Each ``async_to_sync``
call runs in a fresh event loop, while channels_redis keeps its receive lock and buffers on the
layer object across them. The repro: ``ALLOCATIONS_CACHE_S = 0`` hangs that test every time.
Wrapped in ``asyncio.wait_for``, the same receive returns the message when the timeout cancels
it, so that test passes, if slowly. A message that never came fails the test with a line that
says so, instead of stopping the whole run.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from asgiref.sync import async_to_sync

RECEIVE_TIMEOUT_S = 15.0


def received_within(layer: Any, channel: str, timeout_s: float) -> dict[str, Any] | None:
    """The next message on ``channel``, or None if none comes within ``timeout_s``."""
    try:
        return async_to_sync(asyncio.wait_for)(layer.receive(channel), timeout_s)
    except TimeoutError:
        return None


def receive(layer: Any, channel: str, timeout_s: float = RECEIVE_TIMEOUT_S) -> dict[str, Any]:
    """The next message on ``channel``; the test fails after ``timeout_s`` without one."""
    message = received_within(layer, channel, timeout_s)
    if message is None:
        pytest.fail(f"no message on channel {channel} within {timeout_s:g} s", pytrace=False)
    return message
