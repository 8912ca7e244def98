"""The endpoint table and its handlers: what each route of the HTTP API does with
:class:`~sandboxkit.daemon.host.Host`.

Every request body and query is decoded into a typed model of
:mod:`sandboxkit.daemon.schema` (:mod:`.parsing`) before a handler touches any state, so a
bad input is a typed 4xx that changes nothing; every response is encoded so that it
cannot fail (:mod:`.responses`); the router and the OpenAPI document are built from the
table :meth:`Api.endpoints` returns.
"""

from __future__ import annotations

import time
from typing import TypeVar

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from sandboxkit._version import __version__
from sandboxkit.daemon.consumers import CONSUMER_STATES
from sandboxkit.daemon.events import Event
from sandboxkit.daemon.files import FileContent, FileEntry, FileQuery, FilesApi, WriteFile
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.http import parsing
from sandboxkit.daemon.http.endpoint import Endpoint
from sandboxkit.daemon.http.openapi import openapi
from sandboxkit.daemon.http.responses import JsonArrayResponse, JsonResponse
from sandboxkit.daemon.http.stream import FrameStreamResponse
from sandboxkit.daemon.launcher_slot import slot_kind
from sandboxkit.daemon.process import ManagedProcess, ProcessSpec, check_exec_size
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.schema import (
    ConsumerRow,
    CreateSandbox,
    EventRow,
    EventsQuery,
    Health,
    KilledProcess,
    ProcessInfo,
    SandboxInfo,
    SetTimeout,
    StartProcess,
    StartStreamQuery,
    StdinAck,
    StdinBatch,
    StreamQuery,
)
from sandboxkit.errors import (
    FileNotFound,
    InvalidArgument,
    IsolationUnavailable,
    PayloadTooLarge,
    ProcessNotFound,
    ResultUnavailable,
    SandboxNotFound,
    SandboxPaused,
    StdinBusy,
    StdinSeqMismatch,
)

__all__ = ["Api"]

M = TypeVar("M", bound=Struct)


class Api:
    """The handlers of every route, and the table that names them."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.files = FilesApi(host)  # sbx.files: sandboxkit/daemon/files.py

    async def _decode(self, request: Request, model: type[M]) -> M:
        return await parsing.decode(request, model, self.host.config.max_body)

    async def health(self, request: Request) -> Response:
        return JsonResponse(
            {
                "status": "ok",
                "version": __version__,
                "started_at": self.host.started_at,
                "sandboxes": len(self.host.sandboxes),
                "closing": self.host.closing,
                "isolation": self.host.isolation_support(),
                "launcher": slot_kind(self.host.config.standby),
                "spare": self.host.spare_state(),
                "root": str(self.host.root),
                "root_missing": not self.host.root.is_dir(),
                "next_event": self.host.journal.next_seq,
            }
        )

    async def create_sandbox(self, request: Request) -> Response:
        body = await self._decode(request, CreateSandbox)
        # The sandbox's environment goes to every process: refuse one no process could use.
        check_exec_size(["/bin/sh", "-c", ""], body.envs)
        sandbox = await self.host.create_sandbox(
            envs=body.envs,
            timeout=body.timeout,
            on_timeout=body.on_timeout,
            auto_resume=body.auto_resume,
            metadata=body.metadata,
            lab=body.lab,
            isolation=body.isolation,
            allow_internet_access=body.allow_internet_access,
            limits=body.limits,
        )
        return JsonResponse(sandbox.to_json(), status_code=201)

    async def list_sandboxes(self, request: Request) -> Response:
        return JsonArrayResponse(self.host.sandboxes.values(), ManagedSandbox.to_json)

    # Looking is not activity (docs/protocol.md, "What keeps a sandbox alive"): the read
    # routes look a sandbox up with host.get, which neither restarts its idle timer nor
    # resumes it; host.access is for commands, stdin, file writes and streams.

    async def get_sandbox(self, request: Request) -> Response:
        sandbox = self.host.get(request.path_params["sid"])
        return JsonResponse(sandbox.to_json())

    async def kill_sandbox(self, request: Request) -> Response:
        sandbox = self.host.get(request.path_params["sid"])
        await sandbox.kill(reason="user")
        return JsonResponse(sandbox.to_json())

    async def pause_sandbox(self, request: Request) -> Response:
        sandbox = self._alive(request)
        await sandbox.pause(reason="user")
        return JsonResponse(sandbox.to_json())

    async def resume_sandbox(self, request: Request) -> Response:
        sandbox = self._alive(request)
        await sandbox.resume(reason="user")
        return JsonResponse(sandbox.to_json())

    async def set_timeout(self, request: Request) -> Response:
        body = await self._decode(request, SetTimeout)
        sandbox = self._alive(request)
        sandbox.set_timeout(body.timeout)
        return JsonResponse(sandbox.to_json())

    def _alive(self, request: Request) -> ManagedSandbox:
        sid = request.path_params["sid"]
        sandbox = self.host.get(sid)
        sandbox.touch()
        if sandbox.state == "killed":
            raise SandboxNotFound(f"sandbox {sid} was killed", sandbox_id=sid)
        return sandbox

    async def start_process(self, request: Request) -> Response:
        process = await self._start(request)
        return JsonResponse(process.to_json(), status_code=201)

    async def start_stream(self, request: Request) -> Response:
        """Start a process and answer with its output stream from the first chunk: one
        request where a start and a ``GET …/stream`` are two (envd's ``Start`` streams
        alike). Its pid is in the ``start`` frame."""
        query = parsing.query(request, StartStreamQuery)
        process = await self._start(request)
        return self._stream_of(request, process, 0, query.name, query.role)

    async def _start(self, request: Request) -> ManagedProcess:
        body = await self._decode(request, StartProcess)
        # Validated before the sandbox is looked up: access() may auto-resume it.
        spec = ProcessSpec(
            cmd=body.cmd,
            argv=tuple(body.argv) if body.argv is not None else None,
            cwd=body.cwd,
            envs=body.envs,
            pty=body.pty,
            timeout=body.timeout,
            tag=body.tag,
        )
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        return await sandbox.start_process(spec)

    async def list_processes(self, request: Request) -> Response:
        sandbox = self.host.get(request.path_params["sid"])
        return JsonArrayResponse(sandbox.processes.values(), ManagedProcess.to_json)

    async def get_process(self, request: Request) -> Response:
        pid = parsing.pid(request)
        sandbox = self.host.get(request.path_params["sid"])
        return JsonResponse(sandbox.retained_process(pid).to_json())

    async def kill_process(self, request: Request) -> Response:
        pid = parsing.pid(request)
        sandbox = await self.host.access(request.path_params["sid"])
        process = sandbox.process(pid)
        was_running = process.running
        await process.kill(reason="user")
        return JsonResponse({**process.to_json(), "killed": was_running})

    async def restart_process(self, request: Request) -> Response:
        pid = parsing.pid(request)
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        process = await sandbox.restart(pid)
        return JsonResponse(process.to_json(), status_code=201)

    async def write_stdin(self, request: Request) -> Response:
        body = await self._decode(request, StdinBatch)
        pid = parsing.pid(request)
        if body.end:
            if body.data:
                raise InvalidArgument("a batch that ends its session carries no data", field="data")
            sandbox = await self.host.access(request.path_params["sid"])
            return JsonResponse(sandbox.process(pid).end_stdin_session(body.session))
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        process = sandbox.process(pid)
        return JsonResponse(await process.write_stdin(body.session, body.seq, body.data))

    async def close_stdin(self, request: Request) -> Response:
        pid = parsing.pid(request)
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        process = sandbox.process(pid)
        process.close_stdin()
        return JsonResponse(process.to_json())

    async def stream(self, request: Request) -> Response:
        query = parsing.query(request, StreamQuery)
        pid = parsing.pid(request)
        sandbox = await self.host.access(request.path_params["sid"])
        process = sandbox.retained_process(pid)
        return self._stream_of(request, process, query.cursor, query.name, query.role)

    def _stream_of(
        self,
        request: Request,
        process: ManagedProcess,
        cursor: int | None,
        name: str | None,
        role: str | None,
    ) -> Response:
        client = request.client
        consumer = self.host.open_consumer(
            process,
            cursor,
            name=name,
            role=role,
            peer=f"{client.host}:{client.port}" if client else None,
        )
        return FrameStreamResponse(self.host, consumer)

    async def events(self, request: Request) -> Response:
        query = parsing.query(request, EventsQuery)
        sandbox_id = request.path_params.get("sid")
        if sandbox_id is not None:
            self.host.get(sandbox_id)
        journal = self.host.journal
        events = journal.since(query.since, sandbox_id=sandbox_id, pid=query.pid)
        deadline = time.monotonic() + min(query.wait, self.host.config.events_wait_max)
        while not events and not journal.closed and (left := deadline - time.monotonic()) > 0:
            await journal.wait(left, sandbox_id=sandbox_id)
            events = journal.since(query.since, sandbox_id=sandbox_id, pid=query.pid)
        return JsonArrayResponse(events, Event.to_json)

    async def consumers(self, request: Request) -> Response:
        return JsonResponse(self.host.consumer_metrics(request.path_params.get("sid")))

    async def openapi(self, request: Request) -> Response:
        return JsonResponse(openapi(self.endpoints()))

    def endpoints(self) -> list[Endpoint]:
        sbx = "/sandboxes/{sid}"
        proc = sbx + "/processes/{pid}"
        ep = Endpoint
        paused = (SandboxPaused,)
        consumers_doc = "Consumer states: " + "; ".join(
            f"`{name}`: {meaning}" for name, meaning in CONSUMER_STATES.items()
        )
        return [
            ep("GET", "/health", "Daemon health", self.health, response=Health),
            ep("GET", "/openapi.json", "This OpenAPI document", self.openapi, response=dict),
            ep(
                "POST",
                "/sandboxes",
                "Create a sandbox",
                self.create_sandbox,
                body=CreateSandbox,
                response=SandboxInfo,
                status=201,
                errors=(IsolationUnavailable,),
            ),
            ep(
                "GET",
                "/sandboxes",
                "List sandboxes",
                self.list_sandboxes,
                response=list[SandboxInfo],
            ),
            ep("GET", sbx, "Get a sandbox", self.get_sandbox, response=SandboxInfo),
            ep("DELETE", sbx, "Kill and delete a sandbox", self.kill_sandbox, response=SandboxInfo),
            ep(
                "POST",
                sbx + "/pause",
                "Pause (freeze) a sandbox",
                self.pause_sandbox,
                response=SandboxInfo,
            ),
            ep(
                "POST",
                sbx + "/resume",
                "Resume (thaw) a sandbox",
                self.resume_sandbox,
                response=SandboxInfo,
            ),
            ep(
                "POST",
                sbx + "/timeout",
                "Set the idle timeout (restarts it)",
                self.set_timeout,
                body=SetTimeout,
                response=SandboxInfo,
            ),
            ep(
                "POST",
                sbx + "/processes",
                "Start a process",
                self.start_process,
                body=StartProcess,
                response=ProcessInfo,
                status=201,
                errors=paused,
            ),
            ep(
                "POST",
                sbx + "/processes/stream",
                "Start a process and stream its output",
                self.start_stream,
                body=StartProcess,
                query=StartStreamQuery,
                errors=paused,
                description=(
                    "A start and an attach from the first chunk in one request: the "
                    "framed stream of `GET …/processes/{pid}/stream`, whose `start` frame "
                    "names the new process's `pid`. A stream cut off later is resumed "
                    "with that `GET` from the cursor reached."
                ),
            ),
            ep(
                "GET",
                sbx + "/processes",
                "List processes",
                self.list_processes,
                response=list[ProcessInfo],
            ),
            ep(
                "GET",
                proc,
                "Get a process",
                self.get_process,
                response=ProcessInfo,
                errors=(ResultUnavailable,),
            ),
            ep(
                "POST",
                proc + "/kill",
                "Kill a process",
                self.kill_process,
                response=KilledProcess,
                errors=(ProcessNotFound,),
            ),
            ep(
                "POST",
                proc + "/restart",
                "Kill and restart a process",
                self.restart_process,
                response=ProcessInfo,
                status=201,
                errors=(SandboxPaused, ProcessNotFound),
            ),
            ep(
                "POST",
                proc + "/stdin",
                "Write a stdin batch (exactly once per session and seq)",
                self.write_stdin,
                body=StdinBatch,
                response=StdinAck,
                errors=(SandboxPaused, ProcessNotFound, StdinSeqMismatch, StdinBusy),
            ),
            ep(
                "POST",
                proc + "/stdin/close",
                "Close stdin",
                self.close_stdin,
                response=ProcessInfo,
                errors=(SandboxPaused, ProcessNotFound),
            ),
            ep(
                "GET",
                proc + "/stream",
                "Attach a framed output stream",
                self.stream,
                query=StreamQuery,
                errors=(ResultUnavailable,),
                description="`role` labels the consumer in the metrics (default `sdk`).",
            ),
            ep(
                "GET",
                "/events",
                "Event journal",
                self.events,
                query=EventsQuery,
                response=list[EventRow],
            ),
            ep(
                "GET",
                sbx + "/events",
                "A sandbox's events",
                self.events,
                query=EventsQuery,
                response=list[EventRow],
            ),
            ep(
                "GET",
                "/consumers",
                "Consumer metrics",
                self.consumers,
                response=list[ConsumerRow],
                description=consumers_doc,
            ),
            ep(
                "GET",
                sbx + "/consumers",
                "A sandbox's consumer metrics",
                self.consumers,
                response=list[ConsumerRow],
                description=consumers_doc,
            ),
            ep(
                "PUT",
                sbx + "/files",
                "Write a file",
                self.files.write,
                body=WriteFile,
                response=FileEntry,
                status=201,
                errors=(FileNotFound,),
            ),
            ep(
                "GET",
                sbx + "/files",
                "Read a file",
                self.files.read,
                query=FileQuery,
                response=FileContent,
                errors=(FileNotFound, PayloadTooLarge),
            ),
            ep(
                "GET",
                sbx + "/files/list",
                "List a directory",
                self.files.list,
                query=FileQuery,
                response=list[FileEntry],
                errors=(FileNotFound,),
            ),
        ]
