"""One place that hides secrets from log lines and error messages.

Every log record passes through `RedactingFilter` (installed by `recorder serve`), and
every error text shown to a client or a user goes through `redact`: a Postgres URL's
password and any registered token (the admin token) never leave the process.
"""

from __future__ import annotations

import logging
import re

MASK = "***"
# scheme://user:password@host -> scheme://user:***@host (SQLAlchemy, libpq, asyncpg URLs).
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^@\s]+(?=@)")
# libpq keyword form and query parameters: password=... (up to a separator).
_KEY_PASSWORD = re.compile(r"(?P<head>\bpassword=)[^\s&;,'\"]+", re.IGNORECASE)

_secrets: set[str] = set()


def register_secret(value: str) -> None:
    """Hide this exact value from now on (tokens too short to be secret are ignored)."""
    if len(value) >= 4:
        _secrets.add(value)


def redact(text: str) -> str:
    """`text` without URL passwords, `password=` values or registered secrets."""
    text = _URL_PASSWORD.sub(rf"\g<head>{MASK}", text)
    text = _KEY_PASSWORD.sub(rf"\g<head>{MASK}", text)
    for secret in sorted(_secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


class RedactingFilter(logging.Filter):
    """Rewrites a record's final message (arguments and traceback included) redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install_log_redaction() -> None:
    """Redact every line every root handler writes (call after logging is configured)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
