"""API tokens for people and scripts (``manage.py issue_api_token NAME``): shown once, stored as
a SHA-256 digest, sent as ``Authorization: Token <token>`` (jobs.api.auth)."""

from __future__ import annotations

import hashlib
import secrets

from django.conf import settings
from django.db import models

TOKEN_START = "omni_"  # every token begins so; the row keeps the PREFIX_CHARS after it, to tell tokens apart
PREFIX_CHARS = 6


def hash_api_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class ApiToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    label = models.CharField(max_length=64, blank=True, default="")
    digest = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=8, editable=False, help_text="The token's first characters, to tell tokens apart.")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.user} {self.prefix}…"

    @classmethod
    def issue(cls, user, label: str = "") -> tuple[ApiToken, str]:
        """A new token for ``user``: the row, and the token itself (never stored). Its prefix never
        begins with a dash: an operator types it on a command line (``revoke_api_token PREFIX``),
        where a leading dash reads as an option (one token in 64 could not be named so)."""
        secret = secrets.token_urlsafe(32)
        while secret.startswith("-"):
            secret = secrets.token_urlsafe(32)
        token = TOKEN_START + secret
        row = cls.objects.create(user=user, label=label, digest=hash_api_token(token),
                                 prefix=token[len(TOKEN_START):len(TOKEN_START) + PREFIX_CHARS])
        return row, token
