"""What one probe needs, independent of the resource model."""

from __future__ import annotations

from dataclasses import dataclass

from healthgate.model.resources import HealthCheck


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

    @classmethod
    def from_check(cls, check: HealthCheck, ip: str, serving_port: int | None) -> ProbeSpec:
        port = check.port or serving_port
        if port is None:
            raise ValueError(f"no port to probe {ip} with {check.path}")
        return cls(
            type=check.type,
            ip=ip,
            port=port,
            timeout=float(check.timeout_sec),
            interval=float(check.check_interval_sec),
            host=check.host,
            path=check.request_path,
            status_ranges=check.status_ranges(),
            grpc_service=check.grpc_service_name or "",
            contains=(check.response_contains or "").encode(),
            invert=check.invert,
            degraded_ranges=check.degraded_ranges(),
        )

    def expects(self, status: int) -> bool:
        ranges = self.status_ranges
        if len(ranges) == 1:  # the usual case, and this runs for every probe
            return ranges[0][0] <= status <= ranges[0][1]
        return any(lo <= status <= hi for lo, hi in ranges)

    def degraded(self, status: int) -> bool:
        return any(lo <= status <= hi for lo, hi in self.degraded_ranges)

    @property
    def address(self) -> str:
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"
