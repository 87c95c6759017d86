"""Root URLs: pages, the REST API and its OpenAPI schema, login/logout and the admin.

Both sign-in pages count failed attempts per client address (``jobs.api.throttles``): past the
rate a POST is a 429 before any password is hashed."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

from jobs.agent_api import heartbeat_view
from jobs.api.throttles import throttle_failed_logins

urlpatterns = [
    path("", include("jobs.urls")),
    path("login/", throttle_failed_logins(auth_views.LoginView.as_view(redirect_authenticated_user=True)), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/telemetry/", include("telemetry.api.urls")),
    path("api/", include("jobs.api.urls")),
    path("agent/heartbeat/", heartbeat_view, name="agent-heartbeat"),  # agents' HTTP fallback
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("admin/login/", throttle_failed_logins(admin.site.login)),  # before the admin's own route
    path("admin/", admin.site.urls),
    path("", include("telemetry.urls")),
]

handler400 = "jobs.views.bad_request"
