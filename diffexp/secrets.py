"""The one place that hides storage passwords before anything is printed, logged or written.

Covers every URL form SQLAlchemy and libpq accept: `user:pw@host`, `:pw@host` and `?password=pw`
(also `&password=`, any case). Use `mask_url` on a URL and `mask_secrets` on free text that may
contain one (error messages, exception strings).
"""

from __future__ import annotations

import re

# scheme://[user]:password@  ->  scheme://[user]:***@
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@?#]*:)(?P<pw>[^\s@/?#]*)@")
# ?password=pw / &password=pw (query parameters, libpq-style; sslpassword unlocks a client key)
_QUERY_KEYS = ("password", "passwd", "pwd", "pass", "sslpassword", "secret", "token")
_QUERY = re.compile(rf"(?P<head>[?&;](?:{'|'.join(_QUERY_KEYS)})=)(?P<pw>[^&\s#'\"]*)", re.IGNORECASE)
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


def passwords_of(url: str) -> list[str]:
    """The password(s) a storage URL carries (userinfo and ?password=), as written and percent-decoded."""
    from urllib.parse import parse_qsl, unquote, urlsplit

    found = [m.group("pw") for m in _USERINFO.finditer(url)] + [m.group("pw") for m in _QUERY.finditer(url)]
    try:
        parts = urlsplit(url)
        found += [parts.password or ""] + [v for k, v in parse_qsl(parts.query) if k.lower() in _QUERY_KEYS]
    except ValueError:
        pass
    found += [unquote(pw) for pw in found]
    return sorted({pw for pw in found if len(pw) >= 3 and pw != MASK}, key=len, reverse=True)


def mask_secrets_of(text: str, url: str) -> str:
    """Free text (a driver's error message, say) with every password masked, including `url`'s own password
    wherever it appears on its own, e.g. echoed back by a database driver."""
    text = mask_secrets(text)
    for password in passwords_of(url):
        text = text.replace(password, MASK)
    return text
