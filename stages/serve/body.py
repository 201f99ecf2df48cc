"""Request bodies for the ingress (stages.serve.http): the size limit enforced while the bytes
stream in, Content-Encoding (gzip, deflate) inflated within the same limit, the one file of a
multipart form; and HTTPError, the JSON refusal every check raises."""
# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime.
import zlib
from typing import Optional

from ray.exceptions import TaskCancelledError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from stages.serve import v2 as serve_v2

__all__ = ["HTTPError", "printable", "read_body", "content_decoded", "first_file"]

_GZIP_MEMBERS = 16  # members of one gzip body (a streaming compressor writes a few)
_MAX_CODINGS = 4  # content codings one body may list; each is a full inflate within the limit


class HTTPError(Exception):
    """A request the app rejects: becomes `{"error": error, "detail": detail}` with `status`."""

    def __init__(self, status: int, error: str, detail: str = "", headers: Optional[dict] = None):
        super().__init__(f"{status} {error}: {detail}")
        self.status, self.error, self.detail, self.headers = status, error, detail, headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.error, "detail": printable(self.detail)}, self.status, self.headers)


def printable(text: str) -> str:
    """`text` as UTF-8 can carry it: a client's lone surrogate ('\\ud800' is legal JSON) quoted
    in an error message made the error response itself fail to encode, a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes.

    Content-Length is checked first (cheap), then bytes are counted as they stream in, because a
    chunked upload has no Content-Length and Serve's proxy enforces no size limit of its own.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not serve_v2.is_decimal(declared):
            raise HTTPError(400, "bad_content_length", f"Content-Length '{declared}' is not a number")
        if int(declared) > limit:
            raise HTTPError(413, "too_large", f"Content-Length {int(declared)} exceeds serve.max_body_bytes="
                                              f"{limit}; send a smaller image")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, "too_large", f"body exceeds serve.max_body_bytes={limit}; send a smaller image")
            chunks.append(chunk)
    except (ClientDisconnect, TaskCancelledError):  # the client left, or the proxy timed it out
        raise HTTPError(400, "client_disconnected", "the body ended early") from None
    request.state.body_read = True  # a timeout from here on is the model side's (http.within)
    # Several Content-Encoding lines are one list (RFC 9110 5.3): headers.get read only the first
    return content_decoded(b"".join(chunks), ", ".join(request.headers.getlist("content-encoding")), limit)


def content_decoded(body: bytes, encoding: str, limit: int) -> bytes:
    """The body without its Content-Encoding (gzip, deflate: what tritonclient's
    request_compression_algorithm sends), inflated to at most `limit` bytes: a small compressed
    body must not become a memory bomb. A list ("gzip, gzip") names codings in the order they were
    applied (RFC 9110 8.4): undone last first, each within the limit."""
    codings = [c.strip().lower() for c in encoding.split(",")]
    if len(codings) > _MAX_CODINGS:
        raise HTTPError(415, "unsupported_content_encoding", f"{len(codings)} content codings; at most "
                                                              f"{_MAX_CODINGS}")
    for coding in reversed(codings):
        body = _undo(body, coding, limit)
    return body


def _undo(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    # gzip and deflate as zlib streams; a bare deflate stream (some clients send one) as raw
    tries = {"gzip": (16 + zlib.MAX_WBITS,), "x-gzip": (16 + zlib.MAX_WBITS,),
             "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}.get(encoding)
    if tries is None:
        raise HTTPError(415, "unsupported_content_encoding",
                        f"Content-Encoding '{encoding[:40]}'; send the body as gzip, deflate or identity")
    for wbits in tries:
        try:
            plain = _inflate(body, wbits, limit, encoding)
        except zlib.error:
            continue
        if plain is not None:
            return plain
    raise HTTPError(400, "bad_content_encoding", f"the body is not a complete {encoding} stream")


def _inflate(body: bytes, wbits: int, limit: int, encoding: str) -> bytes | None:
    """Every member of a gzip body (RFC 1952 allows several; Python's gzip reads them all), or
    the one zlib/deflate stream; None when the body ends inside a stream or goes on after it."""
    parts, size, rest = [], 0, body
    for _ in range(_GZIP_MEMBERS):  # each member copies the rest of the body: a cap, not 200k members
        inflate = zlib.decompressobj(wbits)
        parts.append(inflate.decompress(rest, limit + 1 - size))
        size += len(parts[-1])
        if size > limit or inflate.unconsumed_tail:
            raise HTTPError(413, "too_large", f"the {encoding} body inflates past serve.max_body_bytes={limit}; "
                                              "send a smaller image")
        rest = inflate.unused_data
        if not inflate.eof or (rest and wbits != 16 + zlib.MAX_WBITS):
            return None
        if not rest.strip(b"\0"):  # gzip(1) accepts zero padding after the last member
            return b"".join(parts)
    raise HTTPError(400, "bad_content_encoding", f"the body holds more than {_GZIP_MEMBERS} gzip members; "
                                                 "compress it as one")


async def first_file(body: bytes, request: Request) -> bytes:
    """Content of the one file part of an already size-checked multipart/form-data body.

    Parsed by python-multipart (through Starlette) from the buffered bytes, so a form can't get
    past max_body_bytes. A part is a file when it has a filename; the field name doesn't matter.
    A form with a second file is refused: /predict answers for one image, and a client that sent
    two had the second dropped without a word.
    """
    async def replay() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=1, max_fields=32)
    except (MultiPartException, StarletteHTTPException) as e:  # Starlette wraps the parser's in its own
        detail = str(getattr(e, "detail", None) or e)
        if detail.startswith("Too many files"):
            raise HTTPError(400, "too_many_files", "/predict classifies one image a request and the form holds "
                            "more than one file; send one, or send several to /v2/models/<model>/infer "
                            "(one request, N images)") from None
        raise HTTPError(400, "malformed_multipart", detail) from None
    except Exception as e:  # whatever a hostile form trips in the parser is the form's fault
        raise HTTPError(400, "malformed_multipart", type(e).__name__) from None
    try:
        for _, value in form.multi_items():
            if isinstance(value, UploadFile):
                return await value.read()
    finally:
        await form.close()
    raise HTTPError(400, "missing_file", "no complete file part in the form; send the image as a file field")
