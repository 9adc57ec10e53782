"""The chat page `k3kit serve` answers at `/`: static files shipped in k3kit/serve/static/.

No build step and nothing fetched at run time: the page is plain HTML, CSS and one script, read
from the package once when the app is built and served from memory. Every response carries a
Content-Security-Policy that lets the page load and connect to its own origin only, so a browser
refuses any request elsewhere even if a reply's Markdown tried one (the renderer escapes HTML
first in any case). These routes are public (the page must load before it can ask for the API
key); everything they return is the same for every visitor.
"""

from __future__ import annotations

from importlib import resources

from starlette.responses import Response

from k3kit.serve.api import APIError

# name -> media type; the only files served (no path from the URL ever reaches the file system)
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
STATIC_PREFIX = "/static/"

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


class Page:
    """The shipped assets, read once. `auth_required` is written into the page (data-auth on its
    <html>), so that the page asks for the key before its first call instead of after a 401."""

    def __init__(self, auth_required: bool = False) -> None:
        root = resources.files("k3kit.serve") / "static"
        self.files = {name: (root / name).read_bytes() for name in ASSETS}
        if auth_required:
            html = self.files["index.html"]
            self.files["index.html"] = html.replace(b'data-auth="none"', b'data-auth="required"', 1)

    def response(self, name: str) -> Response:
        if name not in self.files:
            raise APIError(404, f"no route {STATIC_PREFIX}{name}", type="not_found_error")
        return Response(self.files[name], media_type=ASSETS[name], headers=HEADERS)


def is_public(path: str) -> bool:
    """The page and its assets need no API key."""
    return path == "/" or path.startswith(STATIC_PREFIX)
