"""Small strict readers for environment variables.

Every setting that comes from the environment goes through one of these, so that a bad value
stops start-up with a message naming the variable (healthchecks' ``envbool``/``envint``).
A secret may also come from ``NAME_FILE``, the path of a file holding it.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, unquote, urlsplit


class EnvError(Exception):
    """A variable in the environment has a value the project cannot use."""


def _raw(name: str) -> str | None:
    file_name = os.environ.get(f"{name}_FILE")
    if file_name:
        try:
            with open(file_name, encoding="utf-8") as fh:
                return fh.read().strip()
        except OSError as exc:
            raise EnvError(f"{name}_FILE: cannot read {file_name!r}: {exc.strerror}") from None
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return value


def env_str(name: str, default: str | None = None) -> str | None:
    value = _raw(name)
    return default if value is None else value


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise EnvError(f"{name}: expected one of 1/0/true/false/yes/no/on/off, got {value!r}")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise EnvError(f"{name}: expected an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise EnvError(f"{name}: must be at least {minimum}, got {number}")
    return number


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise EnvError(f"{name}: expected a number, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise EnvError(f"{name}: must be at least {minimum}, got {number}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def database_from_url(name: str, url: str) -> dict:
    """Turn ``postgres://user:pass@host:port/db?options`` into a Django DATABASES entry."""
    parts = urlsplit(url)
    if parts.scheme in ("postgres", "postgresql", "pgsql"):
        if not parts.path.strip("/"):
            raise EnvError(f"{name}: no database name in {_redact(url)!r}")
        try:
            port = parts.port
        except ValueError:
            raise EnvError(f"{name}: bad port in {_redact(url)!r}") from None
        options = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parts.path.lstrip("/")),
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(port or ""),
            "OPTIONS": options,
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
        }
    if parts.scheme == "sqlite":
        path = unquote(parts.path)
        if parts.netloc:
            path = parts.netloc + path
        if not path:
            raise EnvError(f"{name}: no file in {url!r}")
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": path}
    raise EnvError(f"{name}: unsupported scheme {parts.scheme!r} (use postgres:// or sqlite:///path)")


def check_redis_url(name: str, url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise EnvError(f"{name}: expected redis://host:port/db, got {_redact(url)!r}")
    try:
        parts.port  # noqa: B018 - parsing validates the port
    except ValueError:
        raise EnvError(f"{name}: bad port in {_redact(url)!r}") from None
    return url


def env_port_range(name: str, default: str) -> str:
    """A port range ``LOW-HIGH`` (1024..65535, at least one port); anything else stops start-up."""
    value = _raw(name) or default
    low, sep, high = value.partition("-")
    try:
        first, last = int(low), int(high if sep else low)
    except ValueError:
        raise EnvError(f"{name}: expected a port range like 29400-29999, got {value!r}") from None
    if not 1024 <= first <= last <= 65535:
        raise EnvError(f"{name}: {value!r} is not a range within 1024-65535 (low first)")
    return f"{first}-{last}"


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return parts._replace(netloc=netloc).geturl()
    return url


def env_json_object(name: str) -> dict:
    """A JSON object (``{}`` when unset); anything else stops start-up."""
    import json

    value = _raw(name)
    if value is None:
        return {}
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise EnvError(f"{name}: not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise EnvError(f"{name}: expected a JSON object, got {type(parsed).__name__}")
    return parsed
