"""The one place that hides storage passwords before anything is printed, logged or written.

Covers every URL form SQLAlchemy and libpq accept: `user:pw@host`, `:pw@host` and `?password=pw`
(also `&password=`, any case). Use `mask_url` on a URL and `mask_secrets` on free text that may
contain one (error messages, exception strings).
"""

from __future__ import annotations

import re

# scheme://[user]:password@  ->  scheme://[user]:***@
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@?#]*:)(?P<pw>[^\s@/?#]*)@")
# ?password=pw / &password=pw (query parameters, libpq-style)
_QUERY = re.compile(r"(?P<head>[?&;](?:password|passwd|pwd|pass)=)(?P<pw>[^&\s#'\"]*)", re.IGNORECASE)
# key=value connection strings: "host=... password=pw"
_KEYWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<pw>'[^']*'|[^\s'\"&),;]+)", re.IGNORECASE)

MASK = "***"


def mask_url(url: str) -> str:
    """The URL with any password replaced by ***, safe to print, log or write."""
    return mask_secrets(url)


def mask_secrets(text: str) -> str:
    """Free text with every password inside it replaced by ***."""
    text = _USERINFO.sub(lambda m: m.group("head") + MASK + "@", text)
    text = _QUERY.sub(lambda m: m.group("head") + MASK, text)
    return _KEYWORD.sub(lambda m: m.group("head") + MASK, text)
