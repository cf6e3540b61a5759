"""Which host names are this machine's loopback: what `serve` warns about when it listens beyond it, and what a
server on a loopback address accepts in a request's Host header (DNS rebinding is refused)."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_host(host: str) -> bool:
    """Whether a Host header names this machine's loopback: localhost, 127.x.y.z or [::1], any port (none: an
    HTTP/1.0 client, which sends no Host)."""
    if not host:
        return True
    if host.startswith("["):  # [IPv6]:port
        name = host[1:].partition("]")[0]
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return is_loopback(name) or name.lower().endswith(".localhost")
