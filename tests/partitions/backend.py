"""A region's endpoints inside its namespace: ``python backend.py REGION
IP:PORT...`` serves each address with healthgate.fixtures.regions (``GET``
answers ``region=R endpoint=IP``) until SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys

from healthgate.fixtures.regions import RegionBackends


async def main(region: str, addresses: list[str]) -> None:
    backends = RegionBackends()
    for address in addresses:
        ip, _, port = address.rpartition(":")
        backends.add(region, ip, int(port))
    await backends.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"serving {region} on {' '.join(addresses)}", flush=True)
    await stop.wait()
    await backends.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:]))
