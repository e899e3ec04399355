"""``multipart/form-data`` bodies (file uploads), parsed with the standard library only.

The body is split at the RFC 7578 delimiter (CRLF, ``--``, the boundary); each
part is its headers, a blank line, and its bytes exactly as sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message


class FormError(ValueError):
    pass


@dataclass
class FormPart:
    name: str
    content: bytes
    filename: str | None = None
    content_type: str | None = None


def _params(header_name: str, value: str) -> Message:
    msg = Message()
    msg[header_name] = value
    return msg


def boundary_of(content_type: str) -> bytes:
    msg = _params("content-type", content_type)
    if msg.get_content_type() != "multipart/form-data":
        raise FormError("the body must be multipart/form-data")
    boundary = msg.get_param("boundary")
    if not isinstance(boundary, str) or not 1 <= len(boundary) <= 200:
        raise FormError("the multipart body has no valid boundary")
    try:
        return boundary.encode("ascii")
    except UnicodeEncodeError:
        raise FormError("the multipart boundary is not ASCII") from None


def _headers(block: bytes) -> dict[str, str]:
    headers = {}
    for line in block.decode("utf-8", "replace").split("\r\n"):
        name, sep, value = line.partition(":")
        if not sep:
            raise FormError("a multipart part has a malformed header line")
        headers[name.strip().lower()] = value.strip()
    return headers


def _part(section: bytes) -> FormPart:
    head, sep, content = section.partition(b"\r\n\r\n")
    if not sep:
        raise FormError("a multipart part has no blank line after its headers")
    headers = _headers(head) if head else {}
    disposition = _params("content-disposition", headers.get("content-disposition", ""))
    if disposition.get_content_disposition() != "form-data":
        raise FormError("a multipart part is not form-data")
    name = disposition.get_param("name", header="content-disposition")
    if not isinstance(name, str) or not name:
        raise FormError("a multipart part has no name")
    filename = disposition.get_filename()
    return FormPart(name, content, filename, headers.get("content-type"))


def parse_form(body: bytes, content_type: str) -> dict[str, FormPart]:
    """The parts of a multipart/form-data body by name (the first of each name); raises FormError."""
    boundary = boundary_of(content_type)
    sections = (b"\r\n" + body).split(b"\r\n--" + boundary)
    if len(sections) < 2:
        raise FormError("the multipart body has no parts")
    parts: dict[str, FormPart] = {}
    for section in sections[1:]:
        if section.startswith(b"--"):
            return parts  # the closing delimiter; what follows is the epilogue
        _, sep, rest = section.partition(b"\r\n")  # transport padding, then the part
        if not sep:
            raise FormError("a multipart delimiter is not followed by a line break")
        part = _part(rest)
        parts.setdefault(part.name, part)
    raise FormError("the multipart body has no closing delimiter")
