"""Routes of the jobs API."""

from django.urls import path
from rest_framework.routers import DefaultRouter

from jobs.api.views import (
    ElasticEventViewSet,
    JobViewSet,
    NodeViewSet,
    ReservationViewSet,
    TeamViewSet,
    TokenView,
)

router = DefaultRouter()
router.register("jobs", JobViewSet, basename="job")
router.register("nodes", NodeViewSet, basename="node")
router.register("reservations", ReservationViewSet, basename="reservation")
router.register("teams", TeamViewSet, basename="team")
router.register("events", ElasticEventViewSet, basename="event")

urlpatterns = [path("token/", TokenView.as_view(), name="api-token"), *router.urls]
