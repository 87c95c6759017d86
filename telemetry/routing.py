"""WebSocket routes of the telemetry app."""

websocket_urlpatterns: list = []
