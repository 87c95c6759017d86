"""API views: thin shells over jobs.actions, with role checks, filters and pagination.

Every write refuses the fields it does not take (``serializers.StrictFields``), actions without a
body too (``no_body``): an unknown field is a 400, never silently dropped. A method a view does
not offer is a 405 before any role check (``MethodBeforePermission``).
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db.models import Prefetch, QuerySet
from django.shortcuts import get_object_or_404
from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import MethodNotAllowed, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import actions, roles
from jobs.api.logs import LOG_PARAMETERS, JobLogPageSerializer, job_log_page
from jobs.api.permissions import AuditReader, HasRole, OperatorWrites
from jobs.api.schema import ErrorsAutoSchema
from jobs.api.serializers import (
    ElasticEventSerializer,
    JobSerializer,
    JobSubmitSerializer,
    NoBodySerializer,
    NodeRegisterSerializer,
    NodeSerializer,
    ReservationSerializer,
    TeamDetailSerializer,
    TeamMemberSerializer,
    TeamMemberWriteSerializer,
    TeamStandingSerializer,
    TeamWriteSerializer,
)
from jobs.models import (
    Allocation,
    ApiToken,
    ElasticEvent,
    Job,
    JobState,
    Node,
    Priority,
    Reservation,
    Team,
    TeamMembership,
)
from jobs.team_data import team_detail, team_standings


def _choice_filter(request: Request, name: str, choices) -> str | None:
    value = request.query_params.get(name)
    if value is None or value == "":
        return None
    valid = [c for c, _ in choices]
    if value not in valid:
        raise ValidationError({name: f"{value!r} is not one of {', '.join(valid)}"})
    return value


def no_body(request: Request) -> None:
    """Refuse a body sent to an action that takes none: each field in it is unknown (400)."""
    NoBodySerializer(data=request.data).is_valid(raise_exception=True)


def _time_filter(request: Request, name: str):
    value = request.query_params.get(name)
    if not value:
        return None
    parsed = parse_datetime(value)
    if parsed is None or parsed.tzinfo is None:
        raise ValidationError({name: f"{value!r} is not an ISO 8601 time with a timezone"})
    return parsed


def _holds_nul(value) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_holds_nul(v) for v in value)
    return False


class RefuseNulCharacters:
    """A NUL character anywhere in a query, a path or a body is a 400 naming where: PostgreSQL
    text cannot hold one, so a filter (``?q=%00``), a name looked up (``"parent": "a\\u0000"``)
    or a path's user was a 500 from the database (found by tests/fuzz). DRF's ``CharField``
    refuses it for its own fields only; this covers every lookup, once, after authentication."""

    def initial(self, request: Request, *args, **kwargs) -> None:
        super().initial(request, *args, **kwargs)
        where = [name for name, values in request.query_params.lists() if _holds_nul([name, *values])]
        where += [name for name, value in kwargs.items() if _holds_nul(value)]
        data = request.data
        items = data.lists() if hasattr(data, "lists") else data.items() if isinstance(data, dict) else []
        where += [str(name) for name, value in items if _holds_nul([name, value])]
        if not isinstance(data, dict) and _holds_nul(data):
            where.append("non_field_errors")
        if where:
            raise ValidationError({name: ["NUL characters are not allowed."] for name in where})


class MethodBeforePermission:
    """A method the view does not offer is a 405, whoever asks: DRF checks permissions before it
    looks for the handler, so ``PUT /api/nodes/1/`` from a researcher was a 403 that read as
    "operators may", though no one may."""

    def check_permissions(self, request: Request) -> None:
        method = request.method.lower()
        if method not in self.http_method_names or not hasattr(self, method):
            raise MethodNotAllowed(request.method)
        super().check_permissions(request)


class JobViewSet(
    RefuseNulCharacters, MethodBeforePermission, mixins.ListModelMixin, mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    """Jobs: everyone with a role reads what ``roles.job_visibility`` allows; researchers submit
    and cancel their own.

    A job the user may not know of is a 404 (list: absent); one they may only summarise comes
    with its summary fields and ``"visibility": "summary"`` (list and detail alike).
    """

    schema = ErrorsAutoSchema()
    serializer_class = JobSerializer
    permission_classes = [HasRole]

    def get_queryset(self) -> QuerySet[Job]:
        allocations = Allocation.objects.select_related("node", "borrowed_from").order_by("node__name", "gpu_index")
        queryset = roles.visible_jobs(
            self.request.user,
            Job.objects.select_related("owner", "rhythm", "team").prefetch_related(Prefetch("allocations", allocations)),
        )
        if self.action != "list":
            return queryset
        params = self.request.query_params
        if state := _choice_filter(self.request, "state", JobState.choices):
            queryset = queryset.filter(state=state)
        if priority := _choice_filter(self.request, "priority", Priority.choices):
            queryset = queryset.filter(priority=priority)
        if owner := params.get("owner"):
            queryset = queryset.filter(owner__username=owner)
        if params.get("mine") in ("1", "true"):
            queryset = queryset.filter(owner=self.request.user)
        if q := params.get("q"):
            queryset = queryset.filter(name__icontains=q)
        if team := params.get("team"):
            queryset = queryset.filter(team__name=team)
        return queryset

    @extend_schema(
        parameters=[
            OpenApiParameter("state", str, enum=[c for c, _ in JobState.choices]),
            OpenApiParameter("priority", str, enum=[c for c, _ in Priority.choices]),
            OpenApiParameter("owner", str),
            OpenApiParameter("mine", bool),
            OpenApiParameter("q", str, description="Part of the job name."),
            OpenApiParameter("team", str, description="Only the jobs of this team (by name)."),
        ]
    )
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=JobSubmitSerializer, responses={201: JobSerializer})
    def create(self, request: Request) -> Response:
        if not roles.can_submit(request.user):
            return Response({"detail": "only researchers and operators submit jobs"}, status=status.HTTP_403_FORBIDDEN)
        submit = JobSubmitSerializer(data=request.data)
        submit.is_valid(raise_exception=True)
        job = actions.submit_job(request.user, **submit.validated_data)
        return Response(self.get_serializer(self.get_queryset().get(pk=job.pk)).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk=None) -> Response:
        no_body(request)
        job = actions.cancel_job(self.get_object(), request.user)
        return Response(self.get_serializer(self.get_queryset().get(pk=job.pk)).data)

    # -- the ranks' log lines (docs/logs.md): query, visibility and paging in jobs/api/logs.py --
    @extend_schema(parameters=LOG_PARAMETERS, responses={200: JobLogPageSerializer})
    @action(detail=True, methods=["get"])
    def logs(self, request: Request, pk=None) -> Response:
        """The job's log lines, oldest first, by rank and stream, paged by line id; for those who
        see the job in full (others: 403, or 404 for a job they may not know of)."""
        return Response(job_log_page(request, pk))


class NodeViewSet(
    RefuseNulCharacters, MethodBeforePermission, mixins.ListModelMixin, mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    """Nodes: everyone with a role reads; operators register, cordon, drain, uncordon and repair."""

    schema = ErrorsAutoSchema()
    serializer_class = NodeSerializer
    permission_classes = [OperatorWrites]
    queryset = Node.objects.prefetch_related("allocations")

    @extend_schema(request=NodeRegisterSerializer, responses={201: NodeSerializer})
    def create(self, request: Request) -> Response:
        register = NodeRegisterSerializer(data=request.data)
        register.is_valid(raise_exception=True)
        node = actions.register_node(request.user, **register.validated_data)
        return Response(NodeSerializer(self.get_queryset().get(pk=node.pk)).data, status=status.HTTP_201_CREATED)

    def _act(self, request: Request, node_action) -> Response:
        no_body(request)
        node = node_action(self.get_object(), request.user)
        return Response(NodeSerializer(self.get_queryset().get(pk=node.pk)).data)

    @extend_schema(request=None)
    @action(detail=True, methods=["post"])
    def cordon(self, request: Request, pk=None) -> Response:
        return self._act(request, actions.cordon_node)

    @extend_schema(request=None)
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, pk=None) -> Response:
        return self._act(request, actions.uncordon_node)

    @extend_schema(request=None)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk=None) -> Response:
        return self._act(request, actions.drain_node)

    @extend_schema(request=None)
    @action(detail=True, methods=["post"])
    def repair(self, request: Request, pk=None) -> Response:
        return self._act(request, actions.mark_node_repaired)


class ReservationViewSet(
    RefuseNulCharacters,
    MethodBeforePermission,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    viewsets.GenericViewSet,
):
    """Reservations: everyone with a role reads; operators create, edit and cancel."""

    schema = ErrorsAutoSchema()
    serializer_class = ReservationSerializer
    permission_classes = [OperatorWrites]
    queryset = Reservation.objects.select_related("job", "team")

    def perform_create(self, serializer) -> None:
        serializer.instance = actions.create_reservation(self.request.user, **serializer.validated_data)

    def perform_update(self, serializer) -> None:
        changes = {k: v for k, v in serializer.validated_data.items() if k in actions.RESERVATION_EDITABLE}
        rejected = set(serializer.validated_data) - set(actions.RESERVATION_EDITABLE)
        if rejected:
            raise ValidationError({field: "this field cannot be changed" for field in sorted(rejected)})
        serializer.instance = actions.update_reservation(serializer.instance, self.request.user, **changes)

    @extend_schema(request=None)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk=None) -> Response:
        no_body(request)
        reservation = actions.cancel_reservation(self.get_object(), request.user)
        return Response(ReservationSerializer(reservation).data)


class TeamViewSet(RefuseNulCharacters, MethodBeforePermission, viewsets.GenericViewSet):
    """Teams (docs/teams.md): everyone with a role reads their standing (GPUs held now against
    quota and borrowing limit), members, jobs (as ``roles.job_visibility`` allows) and
    reservations; operators create, edit (``PATCH``) and delete them and change their members.
    ``PUT`` is not offered: a team's name is fixed, every other field is optional."""

    schema = ErrorsAutoSchema()
    permission_classes = [OperatorWrites]
    queryset = Team.objects.select_related("parent").order_by("name")
    serializer_class = TeamWriteSerializer

    @extend_schema(responses=TeamStandingSerializer(many=True),
                   parameters=[OpenApiParameter("mine", bool, description="Only the teams I am in, each with "
                                                "`default`: whether my submits go there when they name none.")])
    def list(self, request: Request) -> Response:
        """Every team with its standing now; a parent's GPUs are its teams' too."""
        rows = team_standings()
        if request.query_params.get("mine") in ("1", "true"):
            mine = dict(TeamMembership.objects.filter(user=request.user).values_list("team_id", "is_default"))
            rows = [{**row, "default": mine[row["id"]]} for row in rows if row["id"] in mine]
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(page) if page is not None else Response(rows)

    @extend_schema(responses=TeamDetailSerializer)
    def retrieve(self, request: Request, pk=None) -> Response:
        return Response(team_detail(self.get_object(), request.user))

    @extend_schema(request=TeamWriteSerializer, responses={201: TeamDetailSerializer})
    def create(self, request: Request) -> Response:
        write = TeamWriteSerializer(data=request.data)
        write.is_valid(raise_exception=True)
        team = actions.create_team(request.user, **write.validated_data)
        return Response(team_detail(team, request.user), status=status.HTTP_201_CREATED)

    @extend_schema(request=TeamWriteSerializer, responses=TeamDetailSerializer)
    def partial_update(self, request: Request, pk=None) -> Response:
        team = self.get_object()
        write = TeamWriteSerializer(data=request.data, partial=True)
        write.is_valid(raise_exception=True)
        changes = dict(write.validated_data)
        if changes.pop("name", team.name) != team.name:
            raise ValidationError({"name": ["a team's name cannot change: jobs and the audit log know it by it"]})
        team = actions.edit_team(team, request.user, **changes)
        return Response(team_detail(team, request.user))

    def destroy(self, request: Request, pk=None) -> Response:
        no_body(request)
        actions.delete_team(self.get_object(), request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    def _member(self, username: str):
        return get_object_or_404(get_user_model(), username=username)

    @extend_schema(methods=["GET"], responses={200: TeamMemberSerializer(many=True)})
    @extend_schema(methods=["POST"], request=TeamMemberWriteSerializer, responses={201: TeamMemberSerializer(many=True)})
    @action(detail=True, pagination_class=None, methods=["get", "post"])
    def members(self, request: Request, pk=None) -> Response:
        """The team's members; ``POST {"user": NAME, "default": false}`` adds one (operators)."""
        team = self.get_object()
        if request.method == "POST":
            write = TeamMemberWriteSerializer(data=request.data)
            write.is_valid(raise_exception=True)
            user = get_user_model().objects.filter(username=write.validated_data["user"]).first()
            if user is None:
                raise ValidationError({"user": [f"no user named {write.validated_data['user']!r}"]})
            actions.add_team_member(team, request.user, user, default=write.validated_data["default"])
            return Response(team_detail(team, request.user)["members"], status=status.HTTP_201_CREATED)
        return Response(team_detail(team, request.user)["members"])

    @extend_schema(request=None)
    @action(detail=True, methods=["delete"], url_path=r"members/(?P<username>[^/]+)")
    def remove_member(self, request: Request, pk=None, username: str = "") -> Response:
        """Take a member out of the team (operators)."""
        no_body(request)
        actions.remove_team_member(self.get_object(), request.user, self._member(username))
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=None, responses={200: TeamMemberSerializer(many=True)})
    @action(detail=True, pagination_class=None, methods=["post"], url_path=r"members/(?P<username>[^/]+)/default")
    def make_default(self, request: Request, pk=None, username: str = "") -> Response:
        """Make this team the member's default team (operators)."""
        no_body(request)
        team = self.get_object()
        actions.set_default_team(request.user, self._member(username), team)
        return Response(team_detail(team, request.user)["members"])


class ElasticEventViewSet(RefuseNulCharacters, MethodBeforePermission, viewsets.ReadOnlyModelViewSet):
    """The audit log: operators and auditors read everything, researchers the rows of the jobs
    they may see in full (``roles.visible_jobs``: their own, or every job's with
    ``OMNI_JOB_VISIBILITY=all``)."""

    schema = ErrorsAutoSchema()
    serializer_class = ElasticEventSerializer
    permission_classes = [AuditReader]

    def get_queryset(self) -> QuerySet[ElasticEvent]:
        queryset = ElasticEvent.objects.order_by("-id")
        user = self.request.user
        if not roles.can_read_audit(user):
            queryset = roles.visible_jobs(user, queryset, roles.Visibility.FULL, via="job")
        params = self.request.query_params
        if job := params.get("job"):
            queryset = queryset.filter(job_name=job)
        if kinds := params.get("kind"):
            queryset = queryset.filter(kind__in=kinds.split(","))
        if actor := params.get("actor"):
            queryset = queryset.filter(actor=actor)
        if run := params.get("planner_run"):
            queryset = queryset.filter(planner_run=run)
        if since := _time_filter(self.request, "since"):
            queryset = queryset.filter(at__gte=since)
        if until := _time_filter(self.request, "until"):
            queryset = queryset.filter(at__lt=until)
        return queryset

    @extend_schema(
        parameters=[
            OpenApiParameter("job", str, description="Job name."),
            OpenApiParameter("kind", str, description="Comma-separated event kinds."),
            OpenApiParameter("actor", str),
            OpenApiParameter("planner_run", str),
            OpenApiParameter("since", str, description="ISO 8601 time with timezone (inclusive)."),
            OpenApiParameter("until", str, description="ISO 8601 time with timezone (exclusive)."),
        ]
    )
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)


class TokenView(RefuseNulCharacters, MethodBeforePermission, APIView):
    """``DELETE /api/token/``: revoke the API token this request is sent with (``omni logout``);
    it authenticates nothing after. Any account may revoke its own token, whatever its role. A
    request signed in by the session names no token: 400. Operators revoke other tokens with
    ``manage.py revoke_api_token``. Audited (``token_revoked``)."""

    schema = ErrorsAutoSchema(conflicts=False)

    @extend_schema(request=None, responses={204: None})
    def delete(self, request: Request) -> Response:
        no_body(request)
        if not isinstance(request.auth, ApiToken):
            raise ValidationError({"non_field_errors": ["this request carries no API token to revoke "
                                                        "(send it as 'Authorization: Token <token>')"]})
        actions.revoke_api_token(request.user, request.auth)
        return Response(status=status.HTTP_204_NO_CONTENT)
