"""Routes of the jobs API."""

from rest_framework.routers import DefaultRouter

from jobs.api.views import ElasticEventViewSet, JobViewSet, NodeViewSet, ReservationViewSet

router = DefaultRouter()
router.register("jobs", JobViewSet, basename="job")
router.register("nodes", NodeViewSet, basename="node")
router.register("reservations", ReservationViewSet, basename="reservation")
router.register("events", ElasticEventViewSet, basename="event")

urlpatterns = router.urls
