"""The JSON parser of the ingestion endpoints: agent JSON is decoded by the protocol's strict
loader (``trainer_agent.protocol.loads_strict``), the same as on the agent socket, so a batch
nested 50,000 deep, holding ``1e999``, an integer past 64 bits or a lone surrogate is a 400 and
never reaches validation or the database."""

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
