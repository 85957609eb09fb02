"""`create_app(source, settings)`: the FastAPI app, built fresh each time (no module-level state).

Everything the app needs lives on `app.state`: `source` (live or replay),
`hub` (the websocket clients' fan-out, a `hub.ClientHub`), `settings`. The
lifespan starts the source (the subscription to the core, the history writer,
the demo's training thread) and stops it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import agent
from .commands import internal_error
from .hub import ClientHub
from .protocol import StrictJSONResponse, pydantic_detail
from .routes import api, ws
from .security import Guard, SecurityMiddleware, bounded_detail
from .settings import Settings
from .sources import ApiError, Source

log = logging.getLogger("gradient_inspector.server")

SWAGGER_UI = "swagger-ui-5.35.0"  # vendored from the npm package swagger-ui-dist (Apache-2.0)
STATIC_DIR = Path(__file__).parent / "static"


def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("gradient-inspector")
    except Exception:  # not installed (a bare checkout): read the core's version file
        path = Path(__file__).parent.parent / "inspector" / "_version.py"
        try:
            return path.read_text().split("=")[1].strip().strip("\"'")
        except (OSError, IndexError):
            return "unknown"


def frontend_dir() -> Path | None:
    """The dashboard's files: the `frontend` package (importlib), else the checkout's sibling folder."""
    candidates = []
    spec = importlib.util.find_spec("frontend")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) for p in spec.submodule_search_locations]
    candidates.append(Path(__file__).parent.parent / "frontend")
    for path in candidates:
        if (path / "index.html").is_file():
            return path
    return None


def plotly_js() -> Path | None:
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


def create_app(source: Source, settings: Settings | None = None) -> FastAPI:
    """The app for one source (see sources.py).

    Args:
        source: a `LiveSource` (demo or user mode) or a `ReplaySource`.
        settings: bind, token and limits; the token rule is applied by `Settings` itself.
    """
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        hub: ClientHub = app.state.hub

        def publish(kind: str, payload: dict[str, Any], data_text: str | None = None) -> None:  # any thread
            try:
                loop.call_soon_threadsafe(hub.publish, kind, payload, data_text)
            except RuntimeError:  # the loop has closed: the server is gone, training goes on
                pass

        await asyncio.to_thread(source.start, publish)
        try:
            async with app.state.agent():  # the agent interface's transport (agent.py)
                yield
        finally:
            hub.close_all()
            await asyncio.to_thread(source.stop)

    app = FastAPI(
        title="gradient-inspector",
        version=version(),
        description="Live gradients of a PyTorch model, and hooks that edit them. See PROTOCOL.md.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        default_response_class=StrictJSONResponse,
        lifespan=lifespan,
    )
    app.state.source = source
    app.state.settings = settings
    app.state.hub = ClientHub()
    read_only = settings.read_only or source.read_only
    app.state.guard = guard = Guard(
        token=settings.token,
        loopback=settings.loopback,
        read_only=read_only,
        max_body=settings.max_body,
        rate=settings.commands_per_second,
        burst=2 * settings.commands_per_second,
        frame_ancestors=tuple(settings.frame_ancestors),
        streams_per_client=settings.agent_streams_per_client,
        streams=settings.agent_streams,
    )
    app.add_middleware(SecurityMiddleware, guard=guard)  # type: ignore[arg-type]
    _add_error_handlers(app)
    app.include_router(api.router)
    app.state.agent = agent.mount(app, source, read_only=read_only)  # /mcp, behind the same guard
    app.add_api_websocket_route("/ws", ws.websocket_endpoint)
    _add_pages(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return StrictJSONResponse({"detail": bounded_detail(exc.detail)}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = []
        for err in exc.errors():
            loc = tuple(err.get("loc", ()))
            if loc[:1] == ("body",) and len(loc) > 1:  # body fields are named as the core names them
                loc = loc[1:]
            errors.append({**err, "loc": loc})
        return StrictJSONResponse({"detail": bounded_detail(pydantic_detail(errors))}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return StrictJSONResponse(
            {"detail": bounded_detail(exc.detail)}, status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:  # a bug: say so, never a bare 500
        log.exception(
            "gradient-inspector server: unexpected error on %s %s", request.method, request.url.path
        )
        error = internal_error(exc)
        return StrictJSONResponse({"detail": bounded_detail(error.detail)}, status_code=error.status)


def _add_pages(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    def index() -> Response:
        root = frontend_dir()
        if root is None:
            return StrictJSONResponse(
                {"detail": "the dashboard's files are missing (frontend/index.html); the API is at /docs"},
                status_code=404,
            )
        return FileResponse(
            root / "index.html", media_type="text/html", headers={"cache-control": "no-cache"}
        )

    @app.get("/static/{path:path}", include_in_schema=False)
    def static(path: str) -> Response:
        root = frontend_dir()
        # a NUL byte is no file name (resolve() would raise ValueError: a 500)
        target = (root / path).resolve() if root is not None and "\x00" not in path else None
        if (
            root is None
            or target is None
            or not target.is_relative_to(root.resolve())
            or not target.is_file()
            or target.suffix in (".py", ".pyc")
        ):
            return StrictJSONResponse({"detail": f"no such file: /static/{path}"}, status_code=404)
        media = "text/javascript" if target.suffix in (".js", ".mjs") else None
        return FileResponse(target, media_type=media, headers={"cache-control": "no-cache"})

    @app.get("/vendor/plotly.min.js", include_in_schema=False)
    def plotly() -> Response:
        path = plotly_js()
        if path is None:
            return StrictJSONResponse(
                {"detail": "plotly.js not found in the installed plotly package"}, status_code=404
            )
        return FileResponse(path, media_type="text/javascript", headers={"cache-control": "max-age=86400"})

    @app.get("/docs-assets/{name}", include_in_schema=False)
    def docs_asset(name: str) -> Response:
        target = STATIC_DIR / SWAGGER_UI / name
        if "/" in name or "\x00" in name or name.startswith(".") or not target.is_file():
            return StrictJSONResponse({"detail": f"no such file: {name}"}, status_code=404)
        return FileResponse(target, headers={"cache-control": "max-age=86400"})

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="gradient-inspector API",
            swagger_js_url="/docs-assets/swagger-ui-bundle.js",
            swagger_css_url="/docs-assets/swagger-ui.css",
            swagger_favicon_url="/docs-assets/favicon-32x32.png",
        )
