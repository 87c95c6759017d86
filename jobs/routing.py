"""WebSocket routes of the jobs app (agent endpoint and live job/cluster/audit streams)."""

from django.urls import path

from jobs.consumers import AgentConsumer
from jobs.live_consumers import LiveConsumer

websocket_urlpatterns: list = [
    path("ws/live/", LiveConsumer.as_asgi()),
]

# Node agents authenticate with their token, not a browser session or Origin (omniweb/asgi.py).
agent_websocket_urlpatterns: list = [
    path("ws/agent/", AgentConsumer.as_asgi()),
]
