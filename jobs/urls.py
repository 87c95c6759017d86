"""Page routes of the jobs app."""

from django.urls import path

from jobs import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
]
