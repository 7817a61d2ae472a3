"""How the shared sandbox suite sees a backend: specs to open, and an audit of what is left."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recorder.rollout.sandbox import Sandbox, SandboxSpec
from recorder.rollout.sandbox.local import marked_pids

if TYPE_CHECKING:
    from e2b_doubles import E2BDoubles


@dataclass
class Backend:
    """One backend as the shared suite sees it: how to make specs, and how to audit it."""

    name: str
    tmp: Path
    doubles: E2BDoubles | None = None

    def spec(self, **kw: Any) -> SandboxSpec:
        options = {**self._options(), **kw.pop("options", {})}
        return SandboxSpec(backend=self.name, options=options, **kw)

    def _options(self) -> dict[str, Any]:
        if self.doubles is not None:
            return self.doubles.sdk_options()
        return {"root": str(self.tmp / "local")}

    def failing_spec(self) -> SandboxSpec:
        """A spec whose boot fails every time, for a reason the backend cannot retry away."""
        if self.doubles is not None:
            self.doubles.fail_creates(500, 500)
            return self.spec(options={"boot_attempts": 2})
        return self.spec(options={"root": str(self.tmp / "no" / "such" / "dir")})

    async def leftovers(self, sb: Sandbox) -> list[str]:
        """What a killed sandbox left behind: live processes, directories, cloud sandboxes."""
        found: list[str] = []
        if self.doubles is not None:
            await self.doubles.settled()  # E2B removes an expired VM after it stops answering
            found += [f"E2B sandbox {s.id} still running" for s in self.doubles.live()]
            locals_ = [s.local for s in self.doubles.sandboxes.values() if s.id == sb.id]
        else:
            locals_ = [sb]
        for local in locals_:
            found += [f"process {pid}" for pid in marked_pids(local.id)]
            if Path(local.workdir).exists():
                found.append(f"directory {local.workdir}")
        return found
