"""The whole API in this process, on the in-memory store: no subprocess, no port.

``InProcessApi`` wires what ``serve`` wires for the API (store, engine,
control plane following the store's watch, transition recorder) without the
prober's timer or the data plane, and gives an httpx client speaking ASGI to
the app directly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from healthgate.api.app import ApiSettings, ApiState, create_app
from healthgate.api.auth import Access, TokenEntry
from healthgate.api.listener import ApiListener
from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.recorder import TransitionRecorder
from healthgate.controlplane.resources import ControlPlane
from healthgate.store.memory import MemoryStore


class InProcessApi:
    def __init__(
        self,
        tokens: list[dict[str, str]] | None = None,
        public_healthz: bool = False,
        settings: ApiSettings | None = None,
    ) -> None:
        self.public_healthz = public_healthz
        self.settings = settings or ApiSettings()
        self.store = MemoryStore()
        self.health = HealthService()
        self.recorder = TransitionRecorder(self.store)
        self.health.listen(self.recorder)
        self.control = ControlPlane(self.store, self.health)
        entries = [TokenEntry.model_validate(t) for t in tokens] if tokens else None
        self.access = Access(entries, open_access=not entries)
        self._tasks: list[asyncio.Task[Any]] = []
        self.client: httpx.AsyncClient | None = None
        self.state: ApiState | None = None
        self.app: Any = None
        self._listeners: list[ApiListener] = []

    async def __aenter__(self) -> InProcessApi:
        await self.control.load()
        self.control.start()
        self._tasks.append(asyncio.create_task(self.recorder.run()))
        state = ApiState(
            self.control, self.health, self.recorder, self.store, self.access, self.settings
        )
        state.ready = True
        self.state = state
        state.public_healthz = self.public_healthz
        self.app = create_app(state)
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://127.0.0.1:7400"
        )
        return self

    async def listen(self) -> ApiListener:
        """The same app on a real loopback socket, as serve's API listener
        (its bounds from ``settings``); closed with this object."""
        listener = ApiListener("127.0.0.1", 0, self.settings)
        listener.bind()
        await listener.serve(self.app)
        self._listeners.append(listener)
        return listener

    async def __aexit__(self, *exc: Any) -> None:
        for listener in self._listeners:
            await listener.close()
        if self.client is not None:
            await self.client.aclose()
        await self.control.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.health.close()
