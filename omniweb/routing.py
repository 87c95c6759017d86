"""WebSocket routes of every app, gathered in one list."""

from jobs.routing import websocket_urlpatterns as jobs_ws
from telemetry.routing import websocket_urlpatterns as telemetry_ws

websocket_urlpatterns = [*jobs_ws, *telemetry_ws]
