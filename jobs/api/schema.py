"""The API's OpenAPI schema class: every operation also lists the errors it can answer.

drf-spectacular documents only the success of an operation, so a client (or the fuzzer,
tests/fuzz) reading the schema would take each documented refusal in docs/api.md's error table
for an undocumented answer. The shapes are ``jobs.api.errors``'s, once, here.
"""

from __future__ import annotations

from drf_spectacular.openapi import AutoSchema

DETAIL = {
    "type": "object",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}
FIELD_ERRORS = {
    "type": "object",
    "description": "Messages by field (`non_field_errors` for a rule across fields), or `detail` "
                   "for a body that is not strict JSON.",
    "additionalProperties": True,
}
CONFLICT = {
    "type": "object",
    "description": "An illegal state change (`state`, `requested`, `allowed`) or a team still in use (`holders`).",
    "properties": {
        "detail": {"type": "string"},
        "state": {"type": "string"},
        "requested": {"type": "string"},
        "allowed": {"type": "array", "items": {"type": "string"}},
        "holders": {"type": "object", "additionalProperties": True},
    },
    "required": ["detail"],
}

ERRORS = {
    "400": ("A bad value, an unknown field or a body that is not strict JSON.", FIELD_ERRORS),
    "401": ("No credentials, or a bad token.", DETAIL),
    "403": ("The wrong role, or someone else's job.", DETAIL),
    "404": ("No such row, or one you may not know of.", DETAIL),
    "409": ("An illegal state change, or a team still in use.", CONFLICT),
    "429": ("Too many failed tokens from your address (`Retry-After` says for how long).", DETAIL),
}


class ErrorsAutoSchema(AutoSchema):
    """AutoSchema plus the error answers: 404 where the path names a row, 409 on writes that
    move a state machine (``conflicts``; telemetry ingestion has none)."""

    def __init__(self, *, conflicts: bool = True) -> None:
        super().__init__()
        self.conflicts = conflicts

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        codes = ["400", "401", "403", "429"]
        if "{" in self.path:
            codes.append("404")
        if self.conflicts and self.method != "GET":
            codes.append("409")
        for code in sorted(codes):
            description, schema = ERRORS[code]
            responses.setdefault(code, {
                "description": description, "content": {"application/json": {"schema": schema}},
            })
        return responses
