"""Webhook signatures: `Settle-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`."""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Mapping


class SignatureError(ValueError):
    """The body is not what the server signed (or was signed too long ago)."""


def sign(secret: str, body: bytes, at: int | None = None) -> str:
    """The header value the server sends with `body` at `at` (unix seconds; now by default)."""
    t = int(time.time()) if at is None else at
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def verify_webhook(
    secret: str, headers: Mapping[str, str], body: bytes, tolerance_seconds: int = 300, now: float | None = None
) -> None:
    """Raises `SignatureError` unless `body` (the exact bytes received) carries a valid signature
    of `secret` made within `tolerance_seconds` of now. Header names are matched in any case."""
    header = next((v for k, v in headers.items() if k.lower() == "settle-signature"), None)
    if header is None:
        raise SignatureError("no Settle-Signature header")
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        t = int(parts["t"])
        given = bytes.fromhex(parts["v1"])
    except (KeyError, ValueError) as e:
        raise SignatureError("malformed Settle-Signature header") from e
    current = time.time() if now is None else now
    tolerance = abs(tolerance_seconds)
    if not (math.isfinite(current) and math.isfinite(tolerance)):
        # A clock or tolerance that is not a number must never turn the timestamp check off.
        raise SignatureError("the receiver's clock or tolerance is not a number")
    if abs(current - t) > tolerance:
        raise SignatureError("signature timestamp outside the tolerance")
    expected = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).digest()
    if not hmac.compare_digest(given, expected):
        raise SignatureError("signature does not match the body")
