"""Crash-test helper: append single events from many tasks, print each acked id.

Usage: python burst_writer.py URL. Runs until killed. Each line on stdout is
an event id whose append has returned (i.e. was acknowledged as durable).
"""

from __future__ import annotations

import asyncio
import sys

from recorder.log.events import NewEvent, SandboxEvent
from recorder.log.store import open_store


async def writer(store: object, w: int) -> None:
    i = 0
    while True:
        ne = NewEvent(event=SandboxEvent(kind="burst", detail={"w": w, "i": i}))
        await store.append(f"burst-{w}", [ne])  # type: ignore[attr-defined]
        sys.stdout.write(f"{ne.event_id}\n")
        sys.stdout.flush()
        i += 1


async def main(url: str) -> None:
    store = await open_store(url)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await asyncio.gather(*(writer(store, w) for w in range(16)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
