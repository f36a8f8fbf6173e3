"""What one probe needs, independent of the resource model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Final

from healthgate.model.names import ResourcePath
from healthgate.model.resources import HealthCheck

# The PROXY protocol preamble of a health check (haproxy.org's proxy-protocol.txt):
# v1's UNKNOWN and v2's LOCAL command are the forms the protocol names for
# connections the proxy makes on its own, "such as health checks": the
# receiver accepts them and keeps the connection's real addresses.
PROXY_PREAMBLES: Final = {
    "NONE": b"",
    "PROXY_V1": b"PROXY UNKNOWN\r\n",
    # signature, version 2 + LOCAL, family UNSPEC, no address block
    "PROXY_V2": b"\r\n\r\n\x00\r\nQUIT\n\x20\x00\x00\x00",
}


# check -> (the check, its secrets, its spec without an address): the
# objects are held, so an id is never a newer object's
_TEMPLATES: dict[int, tuple[HealthCheck, object, ProbeSpec]] = {}
_TEMPLATES_KEPT: Final = 4096


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    type: str  # TCP, HTTP, HTTPS, GRPC
    ip: str
    port: int
    timeout: float
    interval: float
    host: str | None = None  # Host header and SNI; default the IP
    path: str = "/"
    status_ranges: tuple[tuple[int, int], ...] = ((200, 200),)
    grpc_service: str = ""
    contains: bytes = b""  # HTTP(S): must be in the first 5,120 bytes of the body
    invert: bool = False  # success and failure swap
    # SPEC §9: statuses that are a degraded success (checked before the others)
    degraded_ranges: tuple[tuple[int, int], ...] = ()
    # SPEC §10: what the probe sends (values from secrets included: never shown)
    method: str = "GET"
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    body: bytes = field(default=b"", repr=False)
    send: bytes = field(default=b"", repr=False)  # TCP: written once connected
    expect: bytes = b""  # TCP: the answer's first bytes
    preamble: bytes = b""  # the PROXY protocol's, first on every connection
    verify: bool = False  # HTTPS: verify the server's certificate (else the prober's setting)
    ca: str = field(default="", repr=False)  # ... against this CA (PEM; "": the prober's)
    client_cert: str = field(default="", repr=False)  # PEM: a certificate and its key

    @classmethod
    def from_check(
        cls,
        check: HealthCheck,
        ip: str,
        serving_port: int | None,
        secrets: Mapping[ResourcePath, str] | None = None,
    ) -> ProbeSpec:
        port = check.port or serving_port
        if port is None:
            raise ValueError(f"no port to probe {ip} with {check.path}")
        # one check has the same spec for each of its endpoints but the
        # address: built once (a placement of 100,000 endpoints built each
        # from scratch, 40 us apiece)
        made = _TEMPLATES.get(id(check))
        if made is None or made[0] is not check or made[1] is not secrets:
            if len(_TEMPLATES) >= _TEMPLATES_KEPT:
                _TEMPLATES.clear()
            made = _TEMPLATES[id(check)] = (check, secrets, cls._template(check, secrets))
        return replace(made[2], ip=ip, port=port)

    @classmethod
    def _template(cls, check: HealthCheck, secrets: Mapping[ResourcePath, str] | None) -> ProbeSpec:
        by_field = {r.field: r.target for r in check.references() if r.attr == "secret_refs"}

        def secret(wire_field: str) -> str:
            target = by_field.get(wire_field)
            value = (secrets or {}).get(target) if target is not None else None
            if value is None:  # (a validated world has it: deleting one in use is refused)
                raise ValueError(f"{check.path}: {wire_field} names a secret that is not there")
            return value

        headers = tuple(
            (
                h.name,
                h.value if h.value is not None else secret(f"requestHeaders[{i}].valueFrom.secret"),
            )
            for i, h in enumerate(check.request_headers)
        )
        return cls(
            type=check.type,
            ip="",
            port=0,
            timeout=float(check.timeout_sec),
            interval=float(check.check_interval_sec),
            host=check.host,
            path=check.request_path,
            status_ranges=check.status_ranges(),
            grpc_service=check.grpc_service_name or "",
            contains=(check.response_contains or "").encode(),
            invert=check.invert,
            degraded_ranges=check.degraded_ranges(),
            method=check.method,
            headers=headers,
            body=(check.request_body or "").encode(),
            send=check.send.data() if check.send is not None else b"",
            expect=check.expect.data() if check.expect is not None else b"",
            preamble=PROXY_PREAMBLES[check.proxy_header],
            verify=check.verify,
            ca=secret("caCertificate.secret") if check.ca_certificate is not None else "",
            client_cert=(
                secret("clientCertificate.secret") if check.client_certificate is not None else ""
            ),
        )

    def expects(self, status: int) -> bool:
        ranges = self.status_ranges
        if len(ranges) == 1:  # the usual case, and this runs for every probe
            return ranges[0][0] <= status <= ranges[0][1]
        return any(lo <= status <= hi for lo, hi in ranges)

    def degraded(self, status: int) -> bool:
        return any(lo <= status <= hi for lo, hi in self.degraded_ranges)

    @property
    def plain_tcp(self) -> bool:
        """A TCP check that only connects (the fast path)."""
        return not (self.send or self.expect or self.preamble)

    @property
    def address(self) -> str:
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"
