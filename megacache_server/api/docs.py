"""`/docs` (Swagger UI) served from the package: it must work where no CDN is reachable.

FastAPI's default page loads Swagger UI's script and stylesheet from a CDN, so on an
air-gapped cluster (common for training fleets) it renders blank. The `swagger-ui-bundle`
wheel ([server] extra) ships those files; they are mounted under /docs/assets.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs/assets"


def add_offline_docs(app: FastAPI) -> None:
    """Serve /docs and its assets locally. The app must be built with docs_url=None."""
    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")
