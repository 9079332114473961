"""Images in chat requests: OpenAI's ``image_url`` content parts read into encoded bytes, so an
agent's call renders through the model's processor the way a dataset prompt does.

A part's ``url`` is a ``data:`` URL (base64, as OpenAI's clients send a local image), a
``file://`` URL or a path the sampler's process can read (relative paths from the sampler's
working directory). Remote URLs (``http``, ``https``) are refused: the sampler fetches nothing
from the network on an agent's behalf, and a training sample must not depend on what a server
answered that day. Every refusal is an ``ImageError`` naming the message and the part, which
the endpoint answers as a 400 (``api.BadRequest``).

The other way round, ``openai_messages`` writes a dataset prompt's images into an episode's
``row["prompt"]`` as such parts, so an agent that sends the row back gets the prompt's tokens.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard
from urllib.parse import unquote, urlparse

from actors.data.chat import as_dicts
from actors.data.vision import ImageError, decode, structured
from messages.rollout import ChatMessage


def image_url(part: dict[str, Any], where: str) -> str:
    """The URL of an ``image_url`` part (``{"url": ...}``, or the URL alone as some clients
    send it)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ImageError(f"{where}.image_url: expected {{'url': 'data:image/png;base64,...'}}")
    return url


def read_image(url: str, where: str) -> bytes:
    """The encoded bytes of the image at ``url``, checked to decode (``where`` names the part in
    the error)."""
    scheme = urlparse(url).scheme.lower()
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ImageError(f"{where}: a data URL must be base64 "
                             "('data:image/png;base64,...')")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"{where}: the data URL's base64 does not decode ({exc})") from None
    elif scheme in ("http", "https", "ftp"):
        raise ImageError(f"{where}: remote image URLs are not fetched ({url[:80]!r}); send the "
                         "image as a data URL ('data:image/png;base64,...') or a local path")
    elif scheme in ("", "file") or len(scheme) == 1:  # a path (a one-letter scheme: a drive)
        path = unquote(urlparse(url).path) if scheme == "file" else url
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ImageError(f"{where}: cannot read the image file {path!r} "
                             f"({exc.strerror or exc})") from None
    else:
        raise ImageError(f"{where}: {scheme!r} URLs are not served; send a data URL "
                         "('data:image/png;base64,...') or a local path")
    try:
        decode(data)
    except ImageError as exc:
        raise ImageError(f"{where}: {str(exc).removeprefix('image 0 ')}") from None
    return data


def has_images(content: Any) -> TypeGuard[list[Any]]:
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "image_url" for p in content)


def image_parts(content: list[Any], where: str, images: list[bytes] | None) -> list[dict[str, Any]]:
    """A message's content parts as vision-language chat templates read them (each image a
    ``{"type": "image"}`` part, text parts kept, in order), its images appended to ``images``
    (None: the policy has no vision tower, so an image is refused)."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            continue
        if part.get("type") == "image_url":
            if images is None:
                raise ImageError(f"{where}[{j}]: an image for a text-only policy (its "
                                 "config.json has no vision tower)")
            images.append(read_image(image_url(part, f"{where}[{j}]"), f"{where}[{j}]"))
            out.append({"type": "image"})
        elif part.get("text"):
            out.append({"type": "text", "text": part["text"]})
    return out


def openai_messages(messages: Sequence[ChatMessage], images: Sequence[bytes]) -> list[dict[str, Any]]:
    """A dataset prompt as an episode's ``row["prompt"]``: each ``<image>`` placeholder an
    ``image_url`` part holding its image as a data URL, so an agent that sends the row's
    messages gets the tokens the sampler makes of the prompt (and its sample trains on the
    prompt's images)."""
    if not images:
        return as_dicts(messages)
    return structured(messages, lambda k: {"type": "image_url",
                                           "image_url": {"url": data_url(images[k])}})


def data_url(image: bytes) -> str:
    """``image`` (encoded bytes) as a base64 data URL, its type read from its first bytes."""
    kind = next((k for magic, k in ((b"\xff\xd8", "jpeg"), (b"GIF8", "gif"), (b"RIFF", "webp"))
                 if image.startswith(magic)), "png")
    return f"data:image/{kind};base64," + base64.b64encode(image).decode()
