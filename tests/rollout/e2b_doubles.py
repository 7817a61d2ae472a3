"""Test doubles of E2B's cloud on loopback: its REST API and envd, the daemon in each sandbox.

There is no E2B cloud from CI, so the real SDK (`e2b.AsyncSandbox`) is pointed at
these servers through `api_url` / `sandbox_url` and runs its whole lifecycle
unchanged; only the cloud is doubled, at its wire protocol:

REST API (`api_url`, auth `X-API-KEY`), JSON shaped by the SDK's generated models
(`e2b/api/client/models`):
    POST   /v2/sandboxes                 create (Idempotency-Key honoured)
    GET    /v2/sandboxes                 list the running ones
    GET    /sandboxes/{id}               detail
    DELETE /sandboxes/{id}               kill (404 once gone)
    POST   /sandboxes/{id}/timeout       set the remaining lifetime
envd (`sandbox_url`, one server for every sandbox, picked by the `E2b-Sandbox-Id`
header as E2B's edge proxy does; auth `X-Access-Token`):
    GET  /health
    GET  /files?path=                    download
    POST /files?path=                    upload (multipart/form-data or octet-stream)
    /process.Process/{Start,Connect,List,SendSignal}            Connect RPC, served by
    /filesystem.Filesystem/{Stat,MakeDir,ListDir,Remove,Move}   the server half of
         envd's generated service definitions that the SDK ships
         (`ProcessASGIApplication`, `FilesystemASGIApplication`) through a small
         aiohttp-to-ASGI bridge; stdin, PTY and directory watches are not doubled
A request for a sandbox that was killed or expired gets the edge proxy's answer,
502 "The sandbox ... was not found", which the SDK turns into
`SandboxNotRunningException`.

Each sandbox really runs its commands: it is a `LocalSandbox` (a temp directory,
a process group per command), so the shared suite's semantics hold for real.

Faults for the tests: `fail_creates(429, 500, ...)` answers the next creations
with those statuses, `lose_create_answers(n)` creates but drops the connection
before answering, `envd_down(n)` boots VMs whose envd port is not open,
`hold_creates()` makes creations queue, and `expire(id)` ends a sandbox as its
timeout would (its open streams drop mid-flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import secrets
import shlex
import shutil
import signal
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from e2b.envd.process import process_connect, process_pb
from protobuf import Oneof

from recorder.rollout.sandbox.base import ExecResult, SandboxSpec
from recorder.rollout.sandbox.local import LocalHandle, LocalSandbox

API_KEY = "e2b_" + "0" * 40
ENVD_VERSION = "0.6.4"
DEFAULT_TIMEOUT_S = 300  # E2B's default sandbox lifetime
ProcessEvent = process_pb.ProcessEvent
# What a stream following a process receives: an event, the end of the stream, or
# the sandbox vanishing under it (the VM is gone: the connection drops mid-stream).
GONE = "gone"
Followed = ProcessEvent | None | str


@dataclass
class DoubleProcess:
    """A command envd runs: its output fans out to every stream following it (Start, Connect)."""

    cmd: process_pb.ProcessConfig
    handle: LocalHandle | None = None
    reaper: asyncio.Future[None] | None = None
    followers: list[asyncio.Queue[Followed]] = field(default_factory=list)

    def publish(self, event: Followed) -> None:
        for queue in self.followers:
            queue.put_nowait(event)

    def follow(self) -> asyncio.Queue[Followed]:
        queue: asyncio.Queue[Followed] = asyncio.Queue()
        self.followers.append(queue)
        return queue


@dataclass
class DoubleSandbox:
    id: str
    template: str
    metadata: dict[str, str]
    token: str
    local: LocalSandbox
    started: dt.datetime
    end: dt.datetime
    alive: bool = True
    envd_up: bool = True
    processes: dict[int, DoubleProcess] = field(default_factory=dict)
    expiry: asyncio.TimerHandle | None = None


SANDBOX = web.RequestKey("sandbox", DoubleSandbox)


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


def _end_event(result: ExecResult) -> ProcessEvent:
    """What envd (Go's ProcessState) reports: a signal-killed process is exit code -1."""
    killed = result.exit_code < 0
    return ProcessEvent(
        event=Oneof(
            "end",
            ProcessEvent.EndEvent(
                exit_code=-1 if killed else result.exit_code,
                exited=not killed,
                status="signal: killed" if killed else f"exit status {result.exit_code}",
            ),
        )
    )


def _data_event(stream: str, text: str) -> ProcessEvent:
    return ProcessEvent(
        event=Oneof("data", ProcessEvent.DataEvent(output=Oneof(stream, text.encode())))
    )


class ProcessService:
    """envd's process.Process service over the double's sandboxes."""

    def __init__(self, doubles: E2BDoubles) -> None:
        self._doubles = doubles

    def _sandbox(self, ctx: RequestContext[Any, Any]) -> DoubleSandbox:
        return self._doubles.sandboxes[ctx.request_headers["e2b-sandbox-id"]]

    def _process(self, sandbox: DoubleSandbox, selector: Any) -> DoubleProcess:
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=pid) if pid in sandbox.processes:
                return sandbox.processes[pid]
        raise ConnectError(Code.NOT_FOUND, f"process with {selector} not found")

    async def start(
        self, request: process_pb.StartRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[process_pb.StartResponse]:
        sandbox = self._sandbox(ctx)
        config = request.process or process_pb.ProcessConfig()
        if self._doubles.start_latency_s:
            await asyncio.sleep(self._doubles.start_latency_s)  # a busy VM's envd
        proc = DoubleProcess(cmd=config)
        queue = proc.follow()
        try:
            proc.handle = await sandbox.local.start(
                shlex.join([config.cmd, *config.args]),
                cwd=config.cwd if config.has_field("cwd") else None,
                # envd runs commands as the sandbox user, whose home is the workdir; the
                # host's own login profile (pyenv, cargo...) has no business in a sandbox.
                env={"HOME": sandbox.local.workdir, "USER": "user", **config.envs},
                on_stdout=lambda text: proc.publish(_data_event("stdout", text)),
                on_stderr=lambda text: proc.publish(_data_event("stderr", text)),
            )
        except FileNotFoundError as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, str(exc)) from exc
        pid = proc.handle.pid
        sandbox.processes[pid] = proc
        proc.reaper = asyncio.ensure_future(self._reap(sandbox, pid, proc))
        yield process_pb.StartResponse(
            event=ProcessEvent(event=Oneof("start", ProcessEvent.StartEvent(pid=pid)))
        )
        async for event in _drain(proc, queue):
            yield process_pb.StartResponse(event=event)

    async def _reap(self, sandbox: DoubleSandbox, pid: int, proc: DoubleProcess) -> None:
        assert proc.handle is not None
        try:
            proc.publish(_end_event(await proc.handle.wait()))
        finally:
            sandbox.processes.pop(pid, None)
            proc.publish(None)

    async def connect(
        self, request: process_pb.ConnectRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[process_pb.ConnectResponse]:
        proc = self._process(self._sandbox(ctx), request.process)
        assert proc.handle is not None
        queue = proc.follow()
        yield process_pb.ConnectResponse(
            event=ProcessEvent(event=Oneof("start", ProcessEvent.StartEvent(pid=proc.handle.pid)))
        )
        async for event in _drain(proc, queue):
            yield process_pb.ConnectResponse(event=event)

    async def list(
        self, request: process_pb.ListRequest, ctx: RequestContext[Any, Any]
    ) -> process_pb.ListResponse:
        sandbox = self._sandbox(ctx)
        return process_pb.ListResponse(
            processes=[
                process_pb.ProcessInfo(config=p.cmd, pid=pid)
                for pid, p in sandbox.processes.items()
            ]
        )

    async def send_signal(
        self, request: process_pb.SendSignalRequest, ctx: RequestContext[Any, Any]
    ) -> process_pb.SendSignalResponse:
        proc = self._process(self._sandbox(ctx), request.process)
        assert proc.handle is not None
        if request.signal == process_pb.Signal.SIGTERM:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.handle.pid, signal.SIGTERM)
        else:
            await proc.handle.kill()
        return process_pb.SendSignalResponse()

    # Not used by the SDK paths the backend takes (stdin is closed, no PTY).
    async def update(self, request: Any, ctx: Any) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "the envd double has no PTY")

    async def stream_input(self, request: Any, ctx: Any) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "the envd double has no stdin")

    async def send_input(self, request: Any, ctx: Any) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "the envd double has no stdin")

    async def close_stdin(self, request: Any, ctx: Any) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "the envd double has no stdin")


class FilesystemService:
    """envd's filesystem.Filesystem service (no watchers): Stat, MakeDir, ListDir, Remove, Move."""

    def __init__(self, doubles: E2BDoubles) -> None:
        self._doubles = doubles

    def _path(self, ctx: RequestContext[Any, Any], path: str) -> Path:
        sandbox = self._doubles.sandboxes[ctx.request_headers["e2b-sandbox-id"]]
        return Path(sandbox.local.workdir, path)

    async def stat(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        return filesystem_pb.StatResponse(entry=_entry(self._path(ctx, request.path)))

    async def make_dir(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        path = self._path(ctx, request.path)
        if path.exists():
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {path} already exists")
        made = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True)
        _give(self._doubles.sandboxes[ctx.request_headers["e2b-sandbox-id"]].local, made)
        return filesystem_pb.MakeDirResponse(entry=_entry(path))

    async def list_dir(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        root = self._path(ctx, request.path)
        if not root.is_dir():
            raise ConnectError(Code.NOT_FOUND, f"directory {root} not found")
        depth = request.depth or 1
        found = [p for p in sorted(root.rglob("*")) if len(p.relative_to(root).parts) <= depth]
        return filesystem_pb.ListDirResponse(entries=[_entry(p) for p in found])

    async def remove(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        path = self._path(ctx, request.path)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            raise ConnectError(Code.NOT_FOUND, f"path {path} not found")
        return filesystem_pb.RemoveResponse()

    async def move(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        source = self._path(ctx, request.source)
        if not source.exists():
            raise ConnectError(Code.NOT_FOUND, f"path {source} not found")
        target = self._path(ctx, request.destination)
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
        return filesystem_pb.MoveResponse(entry=_entry(target))

    # Directory watches are not doubled.
    async def watch_dir(self, request: Any, ctx: Any) -> AsyncIterator[Any]:
        raise ConnectError(Code.UNIMPLEMENTED, "the envd double does not watch directories")
        yield  # an async generator, as a server stream must be

    async def create_watcher(self, request: Any, ctx: Any) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "the envd double does not watch directories")

    async def get_watcher_events(self, request: Any, ctx: Any) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "the envd double does not watch directories")

    async def remove_watcher(self, request: Any, ctx: Any) -> Any:
        raise ConnectError(Code.UNIMPLEMENTED, "the envd double does not watch directories")


def _entry(path: Path) -> Any:
    if not path.exists() and not path.is_symlink():
        raise ConnectError(Code.NOT_FOUND, f"path {path} not found")
    info = path.lstat()
    kind = (
        filesystem_pb.FileType.SYMLINK
        if path.is_symlink()
        else filesystem_pb.FileType.DIRECTORY
        if path.is_dir()
        else filesystem_pb.FileType.FILE
    )
    return filesystem_pb.EntryInfo(
        name=path.name,
        type=kind,
        path=str(path),
        size=info.st_size,
        mode=stat.S_IMODE(info.st_mode),
        permissions=stat.filemode(info.st_mode),
        owner="user",
        group="user",
    )


async def _drain(
    proc: DoubleProcess, queue: asyncio.Queue[Followed]
) -> AsyncIterator[ProcessEvent]:
    try:
        while (event := await queue.get()) is not None:
            if isinstance(event, str):
                raise ConnectError(
                    Code.UNAVAILABLE,
                    "the connection to the sandbox ended before the stream completed",
                )
            yield event
    finally:  # the client went away: the process goes on, as in envd
        with contextlib.suppress(ValueError):
            proc.followers.remove(queue)


def asgi_handler(
    app: Callable[..., Awaitable[None]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Serve an ASGI app from aiohttp: enough of ASGI for Connect over HTTP/1.1."""

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        delivered = False
        response: web.StreamResponse | None = None

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # until the client leaves (the handler is cancelled)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal response
            if message["type"] == "http.response.start":
                response = web.StreamResponse(status=message["status"])
                for key, value in message.get("headers", []):
                    response.headers.add(key.decode(), value.decode())
                await response.prepare(request)
            elif message["type"] == "http.response.body":
                assert response is not None
                await response.write(message.get("body", b""))
                if not message.get("more_body", False):
                    await response.write_eof()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.raw_path.encode(),
            "root_path": "",
            "query_string": request.query_string.encode(),
            "headers": [(k.lower().encode(), v.encode()) for k, v in request.headers.items()],
            "client": None,
            "server": None,
            "extensions": {},
        }
        await app(scope, receive, send)
        assert response is not None
        return response

    return handle


class E2BDoubles:
    """Both doubles, started on loopback ports; `sdk_options()` points a spec at them."""

    def __init__(self, root: Path) -> None:
        self.root = root  # where the sandboxes' directories go
        self.sandboxes: dict[str, DoubleSandbox] = {}
        self.create_attempts = 0
        self.create_statuses: list[int] = []  # what each creation was answered with
        self._scripted: list[int] = []
        self._envd_down = 0
        self._lost_answers = 0
        self.gate: asyncio.Event | None = None  # when set up, creations wait for it
        self.start_latency_s = 0.0  # envd waits this long before starting a process
        self.in_flight = 0
        self.max_in_flight = 0
        self._by_key: dict[str, str] = {}
        self._runners: list[web.AppRunner] = []
        self.api_url = ""
        self.sandbox_url = ""

    # -- control from tests -----------------------------------------------------------------

    def sdk_options(self, **extra: Any) -> dict[str, Any]:
        return {
            "api_url": self.api_url,
            "sandbox_url": self.sandbox_url,
            "api_key": API_KEY,
            "boot_backoff_s": 0.01,
            **extra,
        }

    def fail_creates(self, *statuses: int) -> None:
        """Answer the next creations with these HTTP statuses, in order."""
        self._scripted.extend(statuses)

    def lose_create_answers(self, count: int) -> None:
        """Make the next creations succeed but drop the connection before answering."""
        self._lost_answers += count

    def envd_down(self, sandboxes: int) -> None:
        """The next sandboxes boot with envd unreachable (the VM is up, its port not open)."""
        self._envd_down += sandboxes

    def hold_creates(self) -> asyncio.Event:
        """Make creations wait until the returned event is set (to watch them queue)."""
        self.gate = asyncio.Event()
        return self.gate

    async def expire(self, sandbox_id: str) -> None:
        """End a sandbox the way its timeout does."""
        await self._end(self.sandboxes[sandbox_id])

    def live(self) -> list[DoubleSandbox]:
        return [s for s in self.sandboxes.values() if s.alive]

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        api = web.Application()
        api.add_routes(
            [
                web.post("/v2/sandboxes", self._create),
                web.get("/v2/sandboxes", self._list),
                web.get("/sandboxes/{id}", self._detail),
                web.delete("/sandboxes/{id}", self._delete),
                web.post("/sandboxes/{id}/timeout", self._set_timeout),
            ]
        )
        envd = web.Application(middlewares=[self._edge_proxy])
        rpc = asgi_handler(process_connect.ProcessASGIApplication(ProcessService(self)))
        fs = asgi_handler(filesystem_connect.FilesystemASGIApplication(FilesystemService(self)))
        envd.add_routes(
            [
                web.get("/health", self._health),
                web.get("/files", self._download),
                web.post("/files", self._upload),
                web.post("/process.Process/{method}", rpc),
                web.post("/filesystem.Filesystem/{method}", fs),
            ]
        )
        self.api_url = await self._serve(api)
        self.sandbox_url = await self._serve(envd)

    async def _serve(self, app: web.Application) -> str:
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        for sandbox in self.live():
            await self._end(sandbox)
        for runner in self._runners:
            await runner.cleanup()

    async def _end(self, sandbox: DoubleSandbox) -> None:
        """The VM stops: its streams drop at once, then its processes and files go."""
        sandbox.alive = False
        for proc in list(sandbox.processes.values()):
            proc.publish(GONE)
        if sandbox.expiry is not None:
            sandbox.expiry.cancel()
        await sandbox.local.kill()

    async def settled(self) -> None:
        """Wait until every ended sandbox is fully removed (an expiry removes in the background)."""
        for sandbox in self.sandboxes.values():
            if not sandbox.alive:
                await sandbox.local.kill()

    def _schedule_expiry(self, sandbox: DoubleSandbox, timeout_s: float) -> None:
        if sandbox.expiry is not None:
            sandbox.expiry.cancel()
        now = dt.datetime.now(dt.UTC)
        sandbox.end = now + dt.timedelta(seconds=timeout_s)
        sandbox.expiry = asyncio.get_running_loop().call_later(
            timeout_s, lambda: asyncio.ensure_future(self._end(sandbox))
        )

    # -- REST API ---------------------------------------------------------------------------

    def _authorised(self, request: web.Request) -> bool:
        return request.headers.get("X-API-KEY") == API_KEY

    def _running(self, request: web.Request) -> DoubleSandbox | None:
        sandbox = self.sandboxes.get(request.match_info["id"])
        return sandbox if sandbox is not None and sandbox.alive else None

    async def _create(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return _json_error(401, "Invalid API key")
        self.create_attempts += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            return await self._answer_create(request)
        finally:
            self.in_flight -= 1

    async def _answer_create(self, request: web.Request) -> web.Response:
        if self._scripted:
            status = self._scripted.pop(0)
            self.create_statuses.append(status)
            return _json_error(status, f"scripted failure {status}")
        body = await request.json()
        key = request.headers.get("Idempotency-Key")
        if key in self._by_key and self.sandboxes[self._by_key[key]].alive:
            self.create_statuses.append(201)
            return web.json_response(self._created(self.sandboxes[self._by_key[key]]), status=201)
        local = await LocalSandbox.create(
            SandboxSpec(
                env=body.get("envVars", {}), timeout_s=86_400.0, options={"root": str(self.root)}
            )
        )
        now = dt.datetime.now(dt.UTC)
        sandbox = DoubleSandbox(
            id=f"i{secrets.token_hex(8)}",
            template=body["templateID"],
            metadata=body.get("metadata", {}),
            token=secrets.token_hex(16),
            local=local,
            started=now,
            end=now,
        )
        if self._envd_down:
            self._envd_down -= 1
            sandbox.envd_up = False
        self._schedule_expiry(sandbox, float(body.get("timeout", DEFAULT_TIMEOUT_S)))
        self.sandboxes[sandbox.id] = sandbox
        if key:
            self._by_key[key] = sandbox.id
        if self._lost_answers:
            self._lost_answers -= 1
            self.create_statuses.append(0)
            assert request.transport is not None
            request.transport.close()  # the VM exists; its creator never hears of it
            return web.Response(status=500)
        self.create_statuses.append(201)
        return web.json_response(self._created(sandbox), status=201)

    def _created(self, sandbox: DoubleSandbox) -> dict[str, Any]:
        return {
            "templateID": sandbox.template,
            "sandboxID": sandbox.id,
            "clientID": "double",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": sandbox.token,
            "domain": None,
        }

    def _described(self, sandbox: DoubleSandbox) -> dict[str, Any]:
        return {
            "templateID": sandbox.template,
            "sandboxID": sandbox.id,
            "clientID": "double",
            "startedAt": sandbox.started.isoformat(),
            "endAt": sandbox.end.isoformat(),
            "envdVersion": ENVD_VERSION,
            "cpuCount": 2,
            "memoryMB": 512,
            "diskSizeMB": 1024,
            "state": "running",
            "metadata": sandbox.metadata,
        }

    async def _list(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return _json_error(401, "Invalid API key")
        return web.json_response([self._described(s) for s in self.live()])

    async def _detail(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return _json_error(401, "Invalid API key")
        sandbox = self._running(request)
        if sandbox is None:
            return _json_error(404, f"sandbox {request.match_info['id']} not found")
        return web.json_response(self._described(sandbox))

    async def _delete(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return _json_error(401, "Invalid API key")
        sandbox = self._running(request)
        if sandbox is None:
            return _json_error(404, f"sandbox {request.match_info['id']} not found")
        await self._end(sandbox)
        return web.Response(status=204)

    async def _set_timeout(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return _json_error(401, "Invalid API key")
        sandbox = self._running(request)
        if sandbox is None:
            return _json_error(404, f"sandbox {request.match_info['id']} not found")
        self._schedule_expiry(sandbox, float((await request.json())["timeout"]))
        return web.Response(status=204)

    # -- envd -------------------------------------------------------------------------------

    @web.middleware
    async def _edge_proxy(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Route by sandbox id and check its envd token, as E2B's edge proxy and envd do."""
        sandbox_id = request.headers.get("E2b-Sandbox-Id", "")
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None or not sandbox.alive:
            return web.json_response(
                {"message": f"The sandbox {sandbox_id} was not found", "code": 502},
                status=502,
            )
        if not sandbox.envd_up:
            return web.json_response(
                {
                    "message": f"The sandbox {sandbox_id} is running but port is not open",
                    "code": 502,
                },
                status=502,
            )
        if request.headers.get("X-Access-Token") != sandbox.token:
            return _json_error(401, "invalid access token")
        request[SANDBOX] = sandbox
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    def _path(self, request: web.Request, path: str | None = None) -> Path:
        sandbox = request[SANDBOX]
        return Path(sandbox.local.workdir, path if path is not None else request.query["path"])

    async def _download(self, request: web.Request) -> web.Response:
        path = self._path(request)
        if not path.exists():
            return _json_error(404, f"path '{path}' does not exist")
        if path.is_dir():
            return _json_error(400, f"path '{path}' is a directory")
        return web.Response(body=path.read_bytes(), content_type="application/octet-stream")

    async def _upload(self, request: web.Request) -> web.Response:
        written: list[dict[str, str]] = []
        local = request[SANDBOX].local
        if request.content_type == "application/octet-stream":
            written.append(await _store(local, self._path(request), await request.read()))
        else:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                name = request.query.get("path") or part.filename  # type: ignore[union-attr]
                data = await part.read()  # type: ignore[union-attr]
                written.append(await _store(local, self._path(request, name), data))
        return web.json_response(written)


async def _store(local: LocalSandbox, path: Path, data: bytes) -> dict[str, str]:
    """As envd writes: the file, and the directories it makes, are the sandbox user's."""
    made = [p for p in path.parents if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    _give(local, [path, *made])
    return {"name": path.name, "type": "file", "path": str(path)}


def _give(local: LocalSandbox, paths: list[Path]) -> None:
    if local.user is not None:
        for p in paths:
            os.chown(p, local.user.uid, local.user.gid)
