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
_longest_first: tuple[str, ...] = ()  # `_secrets`, a longer one first (it may hold a shorter)


def register_secret(value: str) -> None:
    """Hide this exact value from now on (tokens too short to be secret are ignored)."""
    global _longest_first
    if len(value) >= 4:
        _secrets.add(value)
        _longest_first = tuple(sorted(_secrets, key=len, reverse=True))


def redact(text: str) -> str:
    """`text` without URL passwords, `password=` values or registered secrets.

    Every log line of every turn comes here: a pattern runs only on a text
    that holds what it needs to match (a URL's "://" and "@"; "password=" in
    any case: `casefold` maps each character `re.IGNORECASE` equates with a
    letter of it to that letter), ~1 us a line instead of ~9.
    """
    if "@" in text and "://" in text:
        text = _URL_PASSWORD.sub(rf"\g<head>{MASK}", text)
    if "password=" in text.casefold():
        text = _KEY_PASSWORD.sub(rf"\g<head>{MASK}", text)
    for secret in _longest_first:
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
