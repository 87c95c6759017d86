"""The production backends work against the real servers: Redis as channel layer and broker."""

from __future__ import annotations

import asyncio
import os

import pytest


@pytest.mark.redis
def test_redis_channel_layer_delivers_group_messages():
    from channels_redis.core import RedisChannelLayer

    async def roundtrip() -> dict:
        layer = RedisChannelLayer(hosts=[os.environ["OMNI_TEST_REDIS_URL"]], prefix=f"omni-test-{os.getpid()}")
        channel = await layer.new_channel()
        await layer.group_add("cluster", channel)
        await layer.group_send("cluster", {"type": "live.batch", "messages": [{"event": "node", "payload": {"n": 1}}]})
        message = await asyncio.wait_for(layer.receive(channel), timeout=5)
        await layer.group_discard("cluster", channel)
        await layer.flush()
        return message

    assert asyncio.run(roundtrip())["messages"] == [{"event": "node", "payload": {"n": 1}}]


@pytest.mark.redis
def test_celery_reaches_the_redis_broker():
    from omniweb.celery import app

    with app.connection_for_write(os.environ["OMNI_TEST_REDIS_URL"]) as connection:
        connection.ensure_connection(max_retries=1)
        assert connection.connected


@pytest.mark.postgres
def test_the_suite_runs_on_postgresql(db):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        version = cursor.fetchone()[0]
    assert connection.vendor == "postgresql" and int(version.split(".")[0]) >= 13
