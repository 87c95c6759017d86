"""ASGI entry point: Django for HTTP, Channels for WebSockets (agents and live pages).

Browser sockets go through the session auth middleware and an Origin check; agent sockets
authenticate with their node token inside the consumer (docs/control-loop.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "omniweb.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402

from omniweb.routing import websocket_urlpatterns  # noqa: E402

http_app = django_asgi_app
if settings.EMBEDDED or settings.DEBUG:
    # The embedded mode serves its own static files; production puts them behind a web server.
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    http_app = ASGIStaticFilesHandler(django_asgi_app)

from jobs.routing import agent_websocket_urlpatterns  # noqa: E402

browser_ws_app = AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
agent_ws_app = URLRouter(agent_websocket_urlpatterns)


async def websocket_app(scope, receive, send):
    """Agents (no browser Origin, token auth in the consumer) and browsers take separate paths."""
    if scope.get("path", "").startswith("/ws/agent/"):
        return await agent_ws_app(scope, receive, send)
    return await browser_ws_app(scope, receive, send)


application = ProtocolTypeRouter({"http": http_app, "websocket": websocket_app})
