"""WebSocket routes of the jobs app (agent endpoint and live job/cluster/audit streams)."""

from django.urls import path

from jobs.live_consumers import LiveConsumer

websocket_urlpatterns: list = [
    path("ws/live/", LiveConsumer.as_asgi()),
]
