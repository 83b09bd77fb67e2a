"""What keeps `quantmesh serve` safe when it is reachable by others: the API key, the request size,
and where adapters may be loaded from at run time.

- `Guard` is ASGI middleware in front of every route: with an API key set, a request without
  `Authorization: Bearer KEY` gets a 401 in OpenAI's error shape (the key compared in constant
  time); a body over the limit gets a 413 before any route reads it (the body is read here, so a
  chunked upload without Content-Length is bounded too).
- `adapter_folder` turns a client's adapter path into a folder inside the directory the server was
  started with: relative paths only, no `..`, and nothing in it (the folder or a file inside) may
  resolve outside the directory through a symlink.

Example:
    >>> app.add_middleware(Guard, api_key="secret", max_body=1 << 20)  # doctest: +SKIP
    >>> adapter_folder("/srv/adapters", "team-a/v2")                    # doctest: +SKIP
    PosixPath('/srv/adapters/team-a/v2')
"""

from __future__ import annotations

import hmac
from pathlib import Path, PurePosixPath
from typing import Any

from .protocol import ApiError

__all__ = ["Guard", "adapter_folder"]

_BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


class Guard:
    """ASGI middleware: the API key check and the request body limit (see the module docstring).

    Example:
        >>> app = Guard(app, api_key=None, max_body=1 << 20)  # doctest: +SKIP
    """

    def __init__(self, app: Any, *, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.key is not None:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = ApiError(401, "missing or wrong API key; send the header "
                               "'Authorization: Bearer KEY' with the server's --api-key",
                               code="invalid_api_key")  # fmt: skip
                await err.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        if scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        too_big = ApiError(413, f"the request body is larger than this server's limit of "
                           f"{self.max_body} bytes (--max-request-bytes)",
                           code="request_too_large")  # fmt: skip
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await too_big.response()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left before the body was complete
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                await too_big.response()(scope, receive, send)
                return
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls: the disconnect, for streaming responses

        await self.app(scope, replay, send)


def adapter_folder(root: str | Path, path: str) -> Path:
    """The adapter folder `path` names inside `root`; ApiError(400) when it would leave `root`.

    Example:
        >>> adapter_folder("/srv/adapters", "../etc")  # doctest: +SKIP
        Traceback (most recent call last):
        quantmesh.serve.protocol.ApiError: ...
    """
    rel = PurePosixPath(path)
    if rel.is_absolute() or "\\" in path or (len(path) > 1 and path[1] == ":"):
        raise ApiError(400, f"adapter path {path!r} is absolute; give a path relative to the "
                       "server's adapter directory (--adapter-dir)", param="path")  # fmt: skip
    if ".." in rel.parts:
        raise ApiError(400, f"adapter path {path!r} contains '..'; give a path inside the "
                       "server's adapter directory (--adapter-dir)", param="path")  # fmt: skip
    base = Path(root).resolve()
    folder = (base / rel).resolve()
    outside = ApiError(400, f"adapter path {path!r} leads outside the server's adapter "
                       "directory (a symlink); copy the adapter into it", param="path")  # fmt: skip
    if not folder.is_relative_to(base):
        raise outside
    if not folder.is_dir():
        raise ApiError(400, f"no adapter folder {path!r} in the server's adapter directory",
                       param="path", code="adapter_invalid")  # fmt: skip
    for entry in folder.iterdir():
        if not entry.resolve().is_relative_to(base):
            raise outside
    return folder
