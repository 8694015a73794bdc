"""The viewer's HTTP app on the service layer (rl360/service/app.py): the page (`/`, `/static/...`: plain HTML,
CSS and JS served from this package, nothing fetched from elsewhere) and the JSON API it calls:

- `GET /api/info`: the source's kind, path, row count, list columns and summary (an eval's report).
- `GET /api/filters`: each filter's name and options (a parquet source scans its `data_source` column once).
- `GET /api/rows?offset=0&limit=50&<filter>=<value>...`: `{"total", "offset", "limit", "rows"}`, each row its
  `index` and short forms of its columns.
- `GET /api/row?index=N`: one row whole (`fields`; images as `{"$image": "data:..."}`).
- `GET /api/curve`: a run's metrics by step (run directories).

Reads are blocking (files), so the routes are plain functions FastAPI runs on its thread pool, one at a time
under a lock (sources keep caches)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from rl360.service.app import ServiceError, service_app
from rl360.view.values import MAX_PAGE_ROWS, choice_param, int_param

STATIC = Path(__file__).resolve().parent / "static"
STATIC_FILES = {"viewer.js": "text/javascript", "viewer.css": "text/css"}
PAGE_ROWS = 50
# the page runs only our own script and style; images come inline (data: URIs) from the API
SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                                               "form-action 'none'; frame-ancestors 'none'",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                    "Cache-Control": "no-store"}


def viewer_app(source: Any):
    """The FastAPI app serving `source` (a RolloutSource, EvalSource or ParquetSource)."""
    app = service_app()
    lock = threading.Lock()

    def reply(body: Any) -> JSONResponse:
        return JSONResponse(body, headers=SECURITY_HEADERS)

    def index() -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"), headers=SECURITY_HEADERS)

    def static(name: str) -> FileResponse:
        if name not in STATIC_FILES:
            raise ServiceError(404, f"no file /static/{name}")
        return FileResponse(STATIC / name, media_type=STATIC_FILES[name], headers=SECURITY_HEADERS)

    def info() -> JSONResponse:
        with lock:
            return reply(source.info())

    def filters() -> JSONResponse:
        with lock:
            return reply({"filters": source.filters()})

    def rows(request: Request) -> JSONResponse:
        query = dict(request.query_params)
        offset = int_param(query, "offset", 0, 0, 1 << 62)
        limit = int_param(query, "limit", PAGE_ROWS, 1, MAX_PAGE_ROWS)
        with lock:
            known = {f["name"]: f["options"] for f in source.filters(scan=False)}
            unknown = sorted(set(query) - {"offset", "limit"} - set(known))
            if unknown:
                raise ServiceError(400, f"unknown parameter {unknown[0]!r} (filters here: "
                                        f"{', '.join(known) or 'none'})", unknown[0])
            chosen = {name: choice_param(query, name, options) for name, options in known.items()}
            page = source.page(offset, limit, chosen)
        return reply({"total": page["total"], "offset": offset, "limit": limit, "rows": page["rows"]})

    def row(request: Request) -> JSONResponse:
        query = dict(request.query_params)
        if "index" not in query:
            raise ServiceError(400, "'index' is required: /api/row?index=N", "index")
        with lock:
            total = source.info()["total"]
            if total == 0:
                raise ServiceError(404, "no rows here")
            return reply(source.row(int_param(query, "index", 0, 0, total - 1)))

    def curve() -> JSONResponse:
        if not hasattr(source, "curve"):
            raise ServiceError(404, f"a {source.kind} source has no metrics curve")
        with lock:
            return reply(source.curve())

    app.add_api_route("/", index, methods=["GET"])
    app.add_api_route("/static/{name}", static, methods=["GET"])
    app.add_api_route("/api/info", info, methods=["GET"])
    app.add_api_route("/api/filters", filters, methods=["GET"])
    app.add_api_route("/api/rows", rows, methods=["GET"])
    app.add_api_route("/api/row", row, methods=["GET"])
    app.add_api_route("/api/curve", curve, methods=["GET"])
    return app
