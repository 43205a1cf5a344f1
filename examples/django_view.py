"""A sync view (Django, or any WSGI framework): `run_sql.run_sync(...)` blocks this thread only;
the query runs in the supervisor's pool, never in the web process."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from queries import run_sql

from queryqueue import QueryError


def total(request: HttpRequest) -> JsonResponse:
    values = [int(v) for v in request.GET.get("values", "").split(",") if v]
    placeholders = ",".join("(?)" for _ in values) or "(0)"
    sql = f"SELECT sum(column1), count(*) FROM (VALUES {placeholders})"
    try:
        [[sum_, count]] = run_sql.run_sync({"sql": sql, "params": values})
    except QueryError as exc:
        return JsonResponse({"error": str(exc)}, status=500)
    return JsonResponse({"sum": sum_, "count": count})
