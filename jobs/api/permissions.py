"""API permission classes built on jobs.roles."""

from __future__ import annotations

from rest_framework.permissions import SAFE_METHODS, BasePermission

from jobs import roles


class HasRole(BasePermission):
    """Any of the three roles may read; users with no role see nothing."""

    message = "your account has no Omni role (researcher, operator or auditor)"

    def has_permission(self, request, view) -> bool:
        return roles.has_any_role(request.user)


class OperatorWrites(HasRole):
    """Everyone with a role reads; only operators write."""

    message = "only operators may change this"

    def has_permission(self, request, view) -> bool:
        if not super().has_permission(request, view):
            return False
        return request.method in SAFE_METHODS or roles.is_operator(request.user)


class AuditReader(BasePermission):
    """Operators and auditors read the whole audit log."""

    message = "only operators and auditors may read the audit log"

    def has_permission(self, request, view) -> bool:
        return roles.can_read_audit(request.user) or (
            roles.is_researcher(request.user) and request.method in SAFE_METHODS
        )
