"""One error shape for the whole API: 400 with field messages, 403, 409 for illegal moves."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from jobs.models import BatchInvariantError, IllegalTransition, TeamInUse


def exception_handler(exc, context):
    """Map domain exceptions to HTTP: IllegalTransition and TeamInUse 409, ValidationError 400, PermissionDenied 403."""
    if isinstance(exc, IllegalTransition):
        return Response(
            {"detail": str(exc), "state": exc.current, "requested": exc.target, "allowed": sorted(exc.allowed)},
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, TeamInUse):
        return Response({"detail": str(exc), "holders": exc.holders}, status=status.HTTP_409_CONFLICT)
    if isinstance(exc, DjangoValidationError):
        body = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        return Response(body, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, BatchInvariantError):
        return Response({"non_field_errors": [str(exc)]}, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, DjangoPermissionDenied):
        return Response({"detail": str(exc) or "permission denied"}, status=status.HTTP_403_FORBIDDEN)
    return drf_exception_handler(exc, context)
