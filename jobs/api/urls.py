"""Routes of the jobs API."""

from rest_framework.routers import DefaultRouter

from jobs.api.views import ElasticEventViewSet, JobViewSet, NodeViewSet, ReservationViewSet, TeamViewSet

router = DefaultRouter()
router.register("jobs", JobViewSet, basename="job")
router.register("nodes", NodeViewSet, basename="node")
router.register("reservations", ReservationViewSet, basename="reservation")
router.register("teams", TeamViewSet, basename="team")
router.register("events", ElasticEventViewSet, basename="event")

urlpatterns = router.urls
