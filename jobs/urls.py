"""Page routes of the jobs app: dashboard, job pages, the operator console, teams and the audit review."""

from django.urls import path, re_path

from jobs import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("jobs/new/", views.job_submit, name="job-submit"),
    path("jobs/preview/", views.job_submit_preview, name="job-submit-preview"),
    path("jobs/<int:pk>/", views.job_detail, name="job-page"),
    path("jobs/<int:pk>/cancel/", views.job_cancel, name="job-page-cancel"),
    path("console/", views.console, name="console"),
    path("console/nodes/<int:pk>/<slug:action>/", views.node_action, name="console-node-action"),
    path("console/planner/", views.planner_control, name="console-planner"),
    path("console/reservations/new/", views.reservation_edit, name="console-reservation-new"),
    path("console/reservations/<int:pk>/edit/", views.reservation_edit, name="console-reservation-edit"),
    path("console/reservations/<int:pk>/cancel/", views.reservation_cancel, name="console-reservation-cancel"),
    path("teams/", views.team_list, name="teams"),
    path("teams/new/", views.team_edit, name="team-page-new"),
    path("teams/<int:pk>/", views.team_page, name="team-page"),
    path("teams/<int:pk>/edit/", views.team_edit, name="team-page-edit"),
    path("teams/<int:pk>/delete/", views.team_delete, name="team-page-delete"),
    path("teams/<int:pk>/members/", views.team_members, name="team-page-members"),
    path("audit/", views.audit, name="audit"),
    re_path(r"^audit/export\.(?P<fmt>csv|json)$", views.audit_export, name="audit-export"),
    path("vendor/plotly-<str:version>.min.js", views.plotly_js, name="plotly-js"),
]
