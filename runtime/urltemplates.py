"""A tool's URL as its definition writes it, `{name}` placeholders filled from the params.

Apart from `runtime.outbound` (which judges where a request may go; `runtime.wire` sends it)
because a template is checked where no request is sent: when a definition is saved
(`tooldefs`), when a reviewer's card shows the action's URL (`approvals.card`). Its rules keep
a value from moving a request anywhere the definition did not name; `outbound` then judges
the host.

Pure module: knows no model and reads no settings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, quote, unquote, urlsplit


class TemplateError(ValueError):
    """A URL template that cannot be used (or values it cannot be filled with); the message
    is a sentence a tenant admin can act on, shown as the field's error."""


_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Characters a template may hold outside placeholders: RFC 3986's unreserved and reserved
# ones and '%'. Anything else (spaces, backslashes, non-ASCII) is refused rather than
# guessed at: parsers disagree about them, and a disagreement is how a host check is fooled.
_LITERAL = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*")
_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
_DOT_SEGMENTS = {".", ".."}


@dataclass(frozen=True)
class _Part:
    literal: str
    name: str | None  # the placeholder after the literal, if any


@dataclass(frozen=True)
class UrlTemplate:
    """A tool's URL with `{name}` placeholders filled from the call's params.

    Placeholders may stand only in the path and in query values, and every value is
    percent-encoded whole, so no value can move the request to another scheme, host or
    port, add a path segment or a query parameter, or start a fragment.
    """

    text: str
    parts: tuple[_Part, ...] = field(repr=False)

    @classmethod
    def compile(cls, text: str) -> UrlTemplate:
        parts: list[_Part] = []
        position = 0
        for match in _PLACEHOLDER.finditer(text):
            parts.append(_Part(text[position : match.start()], match.group(1)))
            position = match.end()
        parts.append(_Part(text[position:], None))
        for part in parts:
            if "{" in part.literal or "}" in part.literal:
                raise TemplateError(
                    "Braces are only allowed around a placeholder name, as in {task_id} "
                    "(letters, digits and _, not starting with a digit)."
                )
            if not _LITERAL.fullmatch(part.literal):
                raise TemplateError(
                    "The URL may only contain ASCII letters, digits and URL punctuation: "
                    "percent-encode anything else, and write a non-ASCII host in its xn-- form."
                )
            if _PERCENT.search(part.literal):
                raise TemplateError("A % in the URL must start a percent-encoded byte (%2F).")
        # Braces are neither reserved nor special to urlsplit, so where each placeholder
        # landed can be read off the template as written.
        split = urlsplit(text)
        if split.scheme not in ("http", "https"):
            raise TemplateError("The URL must start with http:// or https://.")
        if "#" in text:
            raise TemplateError("The URL may not have a fragment (#...).")
        if "{" in split.netloc:
            raise TemplateError(
                "Placeholders may only be used in the URL's path and query values, not in "
                "its host, port or user name."
            )
        if "@" in split.netloc:
            raise TemplateError("The URL may not contain a user name or password.")
        try:
            split.port  # noqa: B018 (validates the port)
        except ValueError:
            raise TemplateError("The URL's port must be a number from 0 to 65535.") from None
        if not split.hostname:
            raise TemplateError("The URL must name a host.")
        for pair in split.query.split("&"):
            if "{" in pair.partition("=")[0]:
                raise TemplateError(
                    "Placeholders may be used as query values (?key={name}), not as query keys."
                )
        for segment in split.path.split("/"):
            if "{" not in segment and _dot_segment(segment):
                raise TemplateError("A URL path segment may not be '.' or '..'.")
        return cls(text=text, parts=tuple(parts))

    @property
    def _split(self) -> SplitResult:
        return urlsplit(self.text)

    @property
    def scheme(self) -> str:
        return self._split.scheme

    @property
    def host(self) -> str:
        return (self._split.hostname or "").lower()

    @property
    def placeholders(self) -> tuple[str, ...]:
        """Each name once, in order of first appearance."""
        return tuple(dict.fromkeys(part.name for part in self.parts if part.name is not None))

    def render(self, values: Mapping[str, Any]) -> str:
        out: list[str] = []
        for part in self.parts:
            out.append(part.literal)
            if part.name is None:
                continue
            if part.name not in values:
                raise TemplateError(f"The URL needs a value for {{{part.name}}}.")
            out.append(quote(_scalar(part.name, values[part.name]), safe=""))
        url = "".join(out)
        self._check_path(url)
        return url

    @staticmethod
    def _check_path(url: str) -> None:
        # A whole segment "." or ".." (or %2E%2E, which servers and proxies decode) is
        # resolved away by clients and proxies: /tasks/{id} with id ".." would reach /. So is
        # one a value's encoded slash makes: nginx matches and proxies the URI decoded and
        # normalised, so /tasks/{id} with id "../admin" (sent as ..%2Fadmin) reaches /admin.
        for segment in urlsplit(url).path.split("/"):
            if _dot_segment(segment):
                raise TemplateError("A URL path segment may not be '.' or '..'.")


def _dot_segment(segment: str) -> bool:
    """Whether `segment`, decoded, is or holds a "." or ".." segment (between slashes or
    backslashes, which some servers take for slashes too)."""
    return any(part in _DOT_SEGMENTS for part in re.split(r"[/\\]", unquote(segment)))


def _scalar(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"  # as the params' JSON spells it
    if isinstance(value, str | int | float):
        return str(value)
    what = "null" if value is None else type(value).__name__
    raise TemplateError(f"{{{name}}} must be a string or a number to go into the URL, not {what}.")


# --- Hosts ------------------------------------------------------------------------------
