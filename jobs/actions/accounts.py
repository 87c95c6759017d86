"""People and their credentials: add a user with a role, issue and revoke API tokens; each audited.

The operators' commands (``manage.py add_user``, ``issue_api_token``; docs/operators.md) call
these with ``actor`` None, the server's own command line, which the audit log names ``system``.
A token is shown once, to the caller, and never written anywhere: its row keeps a digest.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from jobs.actions._common import actor_name
from jobs.audit import record_event
from jobs.models import ApiToken
from jobs.roles import OPERATOR, ROLES, require_operator
from jobs.vocab import EventKind


@transaction.atomic
def add_user(actor, *, username: str, role: str, password: str | None = None) -> AbstractBaseUser:
    """A new account with one role (a Django group). Without a password it cannot sign in to the
    pages until one is set; an API token works either way. An operator is staff: the admin is
    their browser (its lists by their role's permissions)."""
    if actor is not None:
        require_operator(actor, "add users")
    errors: dict[str, list[str]] = {}
    if role not in ROLES:
        errors["role"] = [f"{role!r} is not a role: one of {', '.join(ROLES)}"]
    user_model = get_user_model()
    user = user_model(username=username, is_staff=role == OPERATOR)
    if user_model.objects.filter(username=username).exists():
        errors["username"] = [f"a user named {username!r} already exists"]
    else:
        try:
            user.clean_fields(exclude=["password"])
        except ValidationError as exc:
            errors.update(exc.message_dict)
    if password is not None:
        try:
            validate_password(password, user)
        except ValidationError as exc:
            errors["password"] = exc.messages
    if errors:
        raise ValidationError(errors)
    if password is None:
        user.set_unusable_password()
    else:
        user.set_password(password)
    user.save()
    user.groups.add(Group.objects.get(name=role))
    _record_account_event(
        EventKind.USER_ADDED, actor,
        f"added user {username} as {role}{'' if password is not None else ', without a password'}.",
        {"user": username, "role": role, "password": "set" if password is not None else "none"},
    )
    return user


@transaction.atomic
def issue_api_token(actor, user, *, label: str = "") -> tuple[ApiToken, str]:
    """A new API token for ``user``: its row and the token, which the caller shows once. The audit
    row names the token by its prefix, never in full."""
    if actor is not None:
        require_operator(actor, "issue API tokens")
    if not user.is_active:
        raise ValidationError({"user": [f"{user.get_username()} is a disabled account"]})
    if len(label) > ApiToken._meta.get_field("label").max_length:
        raise ValidationError({"label": [f"at most {ApiToken._meta.get_field('label').max_length} characters"]})
    row, token = ApiToken.issue(user, label)
    _record_account_event(
        EventKind.TOKEN_ISSUED, actor,
        f"issued API token {row.prefix}… to {user.get_username()}{f' ({label})' if label else ''}.",
        {"user": user.get_username(), "token": f"{row.prefix}…", "label": label},
    )
    return row, token


def revoke_api_token(actor, row: ApiToken) -> ApiToken:
    """Revoke ``row`` now: it authenticates nothing after this. Its own user may revoke it (``omni
    logout``), an operator any token, the server's command line (``actor`` None) any. A token
    already revoked is a ValidationError that says when. The audit row names it by its prefix."""
    if actor is not None and actor.pk != row.user_id:
        require_operator(actor, "revoke other people's API tokens")
    with transaction.atomic():
        row = ApiToken.objects.select_for_update().select_related("user").get(pk=row.pk)
        if row.revoked_at is not None:
            raise ValidationError({"token": [f"API token {row.prefix}… was already revoked at "
                                             f"{row.revoked_at.isoformat(timespec='seconds')}"]})
        row.revoked_at = timezone.now()
        row.save(update_fields=["revoked_at"])
        owner = row.user.get_username()
        _record_account_event(
            EventKind.TOKEN_REVOKED, actor,
            f"revoked API token {row.prefix}… of {owner}{f' ({row.label})' if row.label else ''}.",
            {"user": owner, "token": f"{row.prefix}…", "label": row.label},
        )
    return row


def _record_account_event(kind: EventKind, actor, text: str, inputs: dict[str, Any]) -> None:
    """The audit row of an account write, its rule named after its kind; ``text`` goes on from
    the actor's name."""
    record_event(kind, actor=actor_name(actor), actor_user=actor,
                 reason={"rule": kind.value, "text": f"{actor_name(actor)} {text}", "inputs": inputs})
