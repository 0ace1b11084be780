"""Security headers on every console response (pages, scripts, the session API), as data: the
error boundary sets them by path prefix, so that an API request crosses no console code."""

from __future__ import annotations

CONSOLE_PREFIX = "/console"

# No inline script or style, nothing from another origin, never framed. uPlot sets styles
# through the CSSOM (element.style), which style-src does not govern.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data: blob:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",  # frame-ancestors for browsers that predate it
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}


# Set by the outermost middleware (gateway.http.edge.Edge) on every response under
# each prefix, errors included; a session's answers are never cached.
PATH_HEADERS = {
    CONSOLE_PREFIX: HEADERS,
    CONSOLE_PREFIX + "/api/": {"cache-control": "no-store"},
}
