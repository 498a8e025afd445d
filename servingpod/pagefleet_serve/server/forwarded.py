"""The client's address behind a proxy: the X-Forwarded-For entry the proxy appended.

A proxy appends its peer's address to X-Forwarded-For; the entries before it are what the
client (or proxies before it) wrote, and a client writes what it likes. uvicorn's proxy
headers take the rightmost entry not from a trusted host, and with `*` every host is
trusted: the leftmost entry, the client's own. A client behind the router that prepended
one escaped the refusal throttle, its fair-queue turn, its batch share and the compile
caps, and wrote the forged address into the access log. Here a peer in
--forwarded-allow-ips names the client by its last entry only: the one it appended.
"""

import ipaddress


class LastHopForwardedFor:
    """ASGI middleware: from a trusted peer, the client is the last X-Forwarded-For entry
    (and the scheme the last X-Forwarded-Proto one); from any other peer both headers are
    ignored."""

    def __init__(self, app, trusted: str) -> None:
        self.app = app
        entries = [entry.strip() for entry in trusted.split(",") if entry.strip()]
        self.any = "*" in entries
        self.networks = [
            ipaddress.ip_network(entry, strict=False) for entry in entries if entry != "*"
        ]

    def trusts(self, peer: str) -> bool:
        if self.any:
            return True
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:  # a Unix socket's peer
            return False
        return any(address in network for network in self.networks)

    async def __call__(self, scope, receive, send) -> None:
        client = scope.get("client")
        if scope["type"] == "http" and client and self.trusts(client[0]):
            last_for = _last_entry(scope["headers"], b"x-forwarded-for")
            if last_for:
                # In place: uvicorn's access log reads the same scope.
                scope["client"] = (last_for, 0)
            last_proto = _last_entry(scope["headers"], b"x-forwarded-proto")
            if last_proto in ("http", "https"):
                scope["scheme"] = last_proto
        await self.app(scope, receive, send)


def _last_entry(headers, name: bytes) -> str:
    """The last comma-separated entry of a header, over all its lines ('' if none)."""
    values = [value for key, value in headers if key.lower() == name]
    if not values:
        return ""
    return values[-1].decode("latin-1").rsplit(",", 1)[-1].strip()
