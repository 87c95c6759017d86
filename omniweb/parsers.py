"""The API's JSON parser, for people's requests and agents' alike: a body is decoded by the agent
protocol's strict loader (``trainer_agent.protocol.loads_strict``, the same as on the agent
socket), so JSON nested 50,000 deep, holding ``1e999``, an integer past 64 bits or a lone
surrogate is a 400 and never reaches a serializer, an action or the database. It is
``DEFAULT_PARSER_CLASSES``' JSON parser (omniweb/settings.py) and the telemetry endpoints' only one.
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from trainer_agent import protocol


class StrictJSONParser(JSONParser):
    """``application/json`` through ``protocol.loads_strict``."""

    def parse(self, stream, media_type=None, parser_context=None) -> Any:
        try:
            return protocol.loads_strict(stream.read())
        except protocol.ProtocolError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
