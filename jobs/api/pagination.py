"""The API's pagination: ``limit``/``offset``, 50 rows by default and never more than
``MAX_LIMIT`` a page, so no request reads a whole table (``?limit=1000000`` gets ``MAX_LIMIT``
rows and a ``next`` link, as DRF caps it; a limit that is not a positive integer gets the
default). Every list endpoint uses it (``DEFAULT_PAGINATION_CLASS``)."""

from __future__ import annotations

from rest_framework.pagination import LimitOffsetPagination

MAX_LIMIT = 500


class ApiPagination(LimitOffsetPagination):
    """DRF's limit/offset with a ceiling, and the bounds in the schema."""

    max_limit = MAX_LIMIT
    limit_query_description = f"Rows per page: 50 by default, at most {MAX_LIMIT}."

    def get_schema_operation_parameters(self, view) -> list[dict]:
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: {"minimum": 1, "maximum": self.max_limit},
                  self.offset_query_param: {"minimum": 0}}
        for parameter in parameters:
            parameter["schema"].update(bounds.get(parameter["name"], {}))
        return parameters
