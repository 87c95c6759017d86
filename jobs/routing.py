"""WebSocket routes of the jobs app (agent endpoint and live job/cluster/audit streams)."""

websocket_urlpatterns: list = []
