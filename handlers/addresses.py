"""Who a request comes from: the address that connected, or the one a trusted proxy says
it forwarded for; and the key its allowances are counted under.

X-Real-IP and X-Forwarded-For are believed only from the addresses in TRUSTED_PROXIES
(none by default): from anyone else they are whatever the client chose to say, and
every per-address allowance keyed on them (the login throttle, the body caps, the
failed-authentication throttle) would be a new one per request.
"""
import ipaddress

import tornado.httputil

# The networks an IPv6 client typically holds: a home or a server gets a /64 at least,
# so keying allowances on the full address would give one client 2^64 of them.
IPV6_CLIENT_PREFIX = 64

# The networks of TRUSTED_PROXIES (settings.Settings.trusted_proxies).
Proxies = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip())
    except ValueError:
        return None


def is_trusted(ip: str, proxies: Proxies) -> bool:
    address = _address(ip)
    return address is not None and any(address in network for network in proxies)


def forwarded_for(peer: str, headers: tornado.httputil.HTTPHeaders, proxies: Proxies) -> str:
    """The client's address: `peer` itself, or, when `peer` is a trusted proxy, the one it
    names (X-Real-IP, else the last address in X-Forwarded-For that is not a trusted proxy
    too). A value that is not an address is ignored."""
    if not proxies or not is_trusted(peer, proxies):
        return peer
    real = _address(headers.get("X-Real-IP", ""))
    if real is not None:
        return str(real)
    chain = [part for part in headers.get("X-Forwarded-For", "").split(",") if part.strip()]
    for part in reversed(chain):
        address = _address(part)
        if address is None:
            return peer
        if not any(address in network for network in proxies):
            return str(address)
    return peer


def forwarded_protocol(peer: str, headers: tornado.httputil.HTTPHeaders, proxies: Proxies,
                       protocol: str) -> str:
    """http or https as the trusted proxy was reached (X-Scheme, X-Forwarded-Proto)."""
    if not proxies or not is_trusted(peer, proxies):
        return protocol
    said = (headers.get("X-Scheme") or headers.get("X-Forwarded-Proto") or "").strip().lower()
    return said if said in ("http", "https") else protocol


def client_key(ip: str) -> str:
    """What an address's allowances are counted under: an IPv4 address as it is, an IPv6
    address by its /64 (an IPv4-mapped one as the IPv4 address)."""
    address = _address(ip)
    if address is None or address.version == 4:
        return ip
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.ip_network(f"{address}/{IPV6_CLIENT_PREFIX}", strict=False))


def peer_address(request: tornado.httputil.HTTPServerRequest) -> str:
    """The address a request came from (after app.server's TRUSTED_PROXIES rule): the
    HTTP server sets one on every request it reads; only a request made by hand has none."""
    address = request.remote_ip
    assert address is not None
    return address
