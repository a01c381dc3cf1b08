"""URL templates: a value filled into a tool's URL never moves the request elsewhere.

A definition's URL is typed by a tenant admin and its placeholders filled from an agent's
params, so each refusal here is a way a value (or the template itself) could otherwise
change the scheme, host, port, path shape or query keys the definition named.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.urltemplates import TemplateError, UrlTemplate


@pytest.mark.parametrize(
    "text",
    [
        "{scheme}://api.example.com/",
        "https://{host}/tasks",
        "https://api.{zone}.example.com/",
        "https://api.example.com:{port}/",
        "https://{user}@api.example.com/",
        "https://user:{pw}@api.example.com/",
        "https://api.example.com/tasks?{key}=1",
        "https://api.example.com/tasks?a=1&{key}",
        "https://api.example.com/tasks#{frag}",
        "https://api.example.com/tasks#x",
        "https://evil.com@api.example.com/",
        "https://api.example.com/{{x}}",
        "https://api.example.com/{x",
        "https://api.example.com/x}",
        "https://api.example.com/{1x}",
        "https://api.example.com/{x-y}",
        "https://api.example.com/{}",
        "ftp://api.example.com/{x}",
        "//api.example.com/{x}",
        "https:///{x}",
        "https://api.example.com:99999/",
        "https://api.example.com/a b",
        "https://api.example.com\\@evil.com/",
        "https://api.example.com/bücher",
        "https://api.example.com/%zz",
        "https://api.example.com/a/../b",
        "https://api.example.com/a/%2e%2E/b",
    ],
)
def test_template_refusals(text: str) -> None:
    with pytest.raises(TemplateError):
        UrlTemplate.compile(text)


def test_template_properties_and_render() -> None:
    template = UrlTemplate.compile(
        "https://API.Example.com:8443/tasks/{task_id}/notes/{task_id}?key={idempotency_key}&v=1"
    )
    assert template.host == "api.example.com"
    assert template.scheme == "https"
    assert template.placeholders == ("task_id", "idempotency_key")
    assert (
        template.render({"task_id": 42, "idempotency_key": "r:1", "unused": {}})
        == "https://API.Example.com:8443/tasks/42/notes/42?key=r%3A1&v=1"
    )
    assert UrlTemplate.compile("http://127.0.0.1:8765/tasks").placeholders == ()
    assert UrlTemplate.compile("http://[::1]:8765/t/{x}").host == "::1"


@pytest.mark.parametrize(
    "value, rendered",
    [
        ("evil.com/", "evil.com%2F"),
        ("@evil.com", "%40evil.com"),
        ("?a=b", "%3Fa%3Db"),
        ("#frag", "%23frag"),
        ("..x/y..", "..x%2Fy.."),
        ("%2E%2E", "%252E%252E"),  # a value's % is data, never an escape
        ("a&b=c", "a%26b%3Dc"),
        ("x y+z", "x%20y%2Bz"),
        ("\r\nHost: evil", "%0D%0AHost%3A%20evil"),
        (True, "true"),
        (1.5, "1.5"),
    ],
)
def test_values_cannot_change_the_url_structure(value: Any, rendered: str) -> None:
    template = UrlTemplate.compile("https://api.example.com/t/{v}/x?q={v}")
    url = template.render({"v": value})
    assert url == f"https://api.example.com/t/{rendered}/x?q={rendered}"
    assert urlsplit(url).hostname == "api.example.com"


@pytest.mark.parametrize("value", [None, {"a": 1}, [1], (1,), b"x"])
def test_non_scalar_values_are_refused(value: Any) -> None:
    with pytest.raises(TemplateError, match="string or a number"):
        UrlTemplate.compile("https://api.example.com/t/{v}").render({"v": value})


def test_a_missing_value_is_refused() -> None:
    with pytest.raises(TemplateError, match=r"\{v\}"):
        UrlTemplate.compile("https://api.example.com/t/{v}").render({})


@pytest.mark.parametrize(
    "value", [".", "..", "../admin", "x/../../admin", "a/./b", "..\\admin", "../..", "x/.."]
)
def test_a_dot_segment_value_is_refused(value: str) -> None:
    # ".." as a whole segment would be resolved away (/t/.. is /), by httpx or a proxy; and
    # as one an encoded slash makes (..%2Fadmin) by a proxy that decodes the path before it
    # normalises it (nginx does): /t/{v}/x with "../admin" would reach /admin/x.
    template = UrlTemplate.compile("https://api.example.com/t/{v}/x")
    with pytest.raises(TemplateError, match="segment"):
        template.render({"v": value})
    assert template.render({"v": ".x"}) == "https://api.example.com/t/.x/x"


_TEMPLATE = UrlTemplate.compile("https://api.example.com:8443/v1/{a}/items/p{b}?q={c}&x=1&r={a}")
_expected = urlsplit(_TEMPLATE.text)
_values = st.one_of(st.text(), st.integers(), st.floats(allow_nan=False), st.booleans())


def _dots(value: Any) -> bool:
    return isinstance(value, str) and any(p in (".", "..") for p in re.split(r"[/\\]", value))


@given(a=_values, b=_values, c=_values)
def test_rendering_never_changes_scheme_host_port_or_path_shape(a: Any, b: Any, c: Any) -> None:
    try:
        url = _TEMPLATE.render({"a": a, "b": b, "c": c})
    except TemplateError:  # the one refusal: a dot segment, once the path is decoded
        assert _dots(a) or _dots(f"p{b}")
        return
    got = urlsplit(url)
    assert (got.scheme, got.hostname, got.port) == ("https", "api.example.com", 8443)
    assert got.path.count("/") == _expected.path.count("/")
    assert [p.partition("=")[0] for p in got.query.split("&")] == ["q", "x", "r"]
    assert got.fragment == ""
    # And as httpx will send it: the same host, port and number of segments.
    sent = httpx.URL(url)
    assert (sent.host, sent.port) == ("api.example.com", 8443)
    assert sent.raw_path.split(b"?")[0].count(b"/") == _expected.path.count("/")
