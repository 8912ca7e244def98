"""E2B's control plane on the daemon (``/api`` on the envd port): the unmodified ``e2b``
SDK, outside its debug mode, creates, pauses, resumes (``connect``), lists and kills
sandboxkit sandboxes — and sandboxkit's E2B provider runs its cloud path (pause/resume,
kill, the panel's buttons, the timeline) against it. Loopback only: every request goes to
this test's daemon, never to E2B.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterator
from typing import Any

import e2b
import httpx
import pytest
from support import wait_until
from test_notebook_panel import last_status, recording_comms

from sandboxkit import AsyncSandbox, Sandbox
from sandboxkit.daemon.envd import EnvdServer
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.errors import ProviderUnsupported
from sandboxkit.notebook import LifecycleTimeline, ProcessPanel
from sandboxkit.notebook.dashboard import SandboxDashboard
from sandboxkit.providers import load

__all__ = ["recording_comms"]  # the fixture, imported to record what widgets send

# Numbered lines, a few hundred a second, until killed.
COUNTER = shlex.join(
    [
        sys.executable,
        "-u",
        "-c",
        "import time\nprint('begin', flush=True)\nfor i in range(10**7):\n"
        "    print(i, flush=True)\n    time.sleep(0.002)\n",  # sleep-ok: the child's pace
    ]
)


# 300 numbered lines over about a second.
FINITE = shlex.join(
    [
        sys.executable,
        "-u",
        "-c",
        "import time\nfor i in range(300):\n"
        "    print(i, flush=True)\n    time.sleep(0.003)\n",  # sleep-ok: the child's pace
    ]
)


def numbered(lines: list[str]) -> list[str]:
    return [str(i) for i in range(len(lines))]


@pytest.fixture(autouse=True)
def no_cloud(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's E2B settings must never send these tests to E2B's cloud."""
    for name in ("E2B_API_KEY", "E2B_DEBUG", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def daemon(envd_daemon: DaemonServer) -> DaemonServer:
    return envd_daemon


@pytest.fixture(scope="module")
def envd(daemon: DaemonServer) -> EnvdServer:
    assert daemon.envd is not None
    return daemon.envd


@pytest.fixture(scope="module")
def opts(daemon: DaemonServer, envd: EnvdServer) -> dict[str, Any]:
    """What the plain SDK needs to use this daemon as its E2B (no debug mode)."""
    return {"api_key": daemon.token, "api_url": envd.api_url, "sandbox_url": envd.sandbox_url}


def state_of(daemon: DaemonServer, sandbox_id: str) -> str:
    return str(daemon.host.sandboxes[sandbox_id].state)


# -- the official SDK against the control plane ----------------------------------------


def test_sdk_lifecycle_create_pause_connect_list_kill(
    daemon: DaemonServer, opts: dict[str, Any]
) -> None:
    sbx = e2b.Sandbox.create(
        template="base", timeout=120, metadata={"team": "r2"}, envs={"GREETING": "hi"}, **opts
    )
    sid = sbx.sandbox_id
    try:
        assert state_of(daemon, sid) == "running"  # a sandboxkit sandbox
        assert daemon.host.sandboxes[sid].timeout == 120
        assert sbx.commands.run("echo $GREETING").stdout == "hi\n"  # envd, routed by header
        pid = sbx.commands.run(FINITE, background=True).pid

        info = sbx.get_info()
        assert (info.sandbox_id, info.template_id, info.metadata) == (sid, "base", {"team": "r2"})
        assert info.state == e2b.SandboxState.RUNNING and info.envd_version == "0.6.4"

        assert sbx.pause() is True
        assert state_of(daemon, sid) == "paused"
        assert sbx.get_info().state == e2b.SandboxState.PAUSED
        assert sbx.pause() is False  # already paused: E2B's 409
        with pytest.raises(e2b.SandboxException, match="paused"):
            sbx.commands.run("echo no")
        listed = {i.sandbox_id: i.state for i in e2b.Sandbox.list(**opts).next_items()}
        assert listed[sid] == e2b.SandboxState.PAUSED

        again = e2b.Sandbox.connect(sid, **opts)  # resumes
        assert state_of(daemon, sid) == "running"
        result = again.commands.connect(pid).wait()  # replayed from sandboxkit's log
        assert result.stdout.split() == [str(i) for i in range(300)], "lost or duplicated"
        assert again.commands.run("echo back").stdout == "back\n"

        again.set_timeout(600)
        assert daemon.host.sandboxes[sid].timeout == 600
    finally:
        assert sbx.kill() is True
    assert state_of(daemon, sid) == "killed"
    assert sbx.kill() is False  # E2B's 404 on a second kill
    with pytest.raises(e2b.SandboxNotFoundException):
        e2b.Sandbox.connect(sid, **opts)
    with pytest.raises(e2b.SandboxNotFoundException):
        e2b.Sandbox.get_info(sid, **opts)
    assert sid not in {i.sandbox_id for i in e2b.Sandbox.list(**opts).next_items()}


async def test_async_sdk_from_env_vars_and_paged_list(
    daemon: DaemonServer, envd: EnvdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("E2B_API_KEY", daemon.token or "")
    monkeypatch.setenv("E2B_API_URL", envd.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", envd.sandbox_url)
    made = [await e2b.AsyncSandbox.create(metadata={"batch": "paged"}) for _ in range(3)]
    try:
        assert (await made[0].commands.run("echo async")).stdout == "async\n"
        await made[1].pause()
        assert state_of(daemon, made[1].sandbox_id) == "paused"
        await e2b.AsyncSandbox.connect(made[1].sandbox_id)
        assert state_of(daemon, made[1].sandbox_id) == "running"

        query = e2b.SandboxQuery(metadata={"batch": "paged"})
        paginator = e2b.AsyncSandbox.list(query=query, limit=2)
        pages = []
        while paginator.has_next:
            pages.append([i.sandbox_id for i in await paginator.next_items()])
        assert [len(p) for p in pages] == [2, 1]  # x-next-token
        assert sorted(sid for page in pages for sid in page) == sorted(s.sandbox_id for s in made)
    finally:
        for sbx in made:
            await sbx.kill()


def test_sdk_reaches_a_sandbox_sandboxkit_made(daemon: DaemonServer, opts: dict[str, Any]) -> None:
    """Every sandbox the daemon holds is an E2B sandbox too: connect by its id."""
    own = Sandbox.create(url=daemon.url, token=daemon.token)
    try:
        own.files.write("note.txt", "made by sandboxkit\n")
        sbx = e2b.Sandbox.connect(own.sandbox_id, **opts)
        assert sbx.commands.run("cat note.txt").stdout == "made by sandboxkit\n"
        assert sbx.get_info().template_id == "sandboxkit"
    finally:
        own.kill()


# -- auth and bad input ---------------------------------------------------------------


def test_wrong_api_key_is_refused_and_creates_nothing(
    daemon: DaemonServer, opts: dict[str, Any]
) -> None:
    before = len(daemon.host.sandboxes)
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.create(**{**opts, "api_key": "not-the-token"})
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.list(**{**opts, "api_key": "not-the-token"}).next_items()
    assert len(daemon.host.sandboxes) == before
    assert isinstance(e2b.Sandbox.list(**opts).next_items(), list)  # the right key works


def test_an_envd_access_token_opens_its_own_sandbox_only(
    daemon: DaemonServer, envd: EnvdServer, opts: dict[str, Any]
) -> None:
    one = e2b.Sandbox.create(**opts)
    two = e2b.Sandbox.create(**opts)
    try:
        token = one._envd_access_token
        assert token and token != daemon.token and token != two._envd_access_token
        url = f"{envd.sandbox_url}/process.Process/List"
        body, headers = b"{}", {"Content-Type": "application/json", "X-Access-Token": token}
        mine = httpx.post(url, content=body, headers={**headers, "E2b-Sandbox-Id": one.sandbox_id})
        assert mine.status_code == 200
        other = httpx.post(url, content=body, headers={**headers, "E2b-Sandbox-Id": two.sandbox_id})
        assert other.status_code == 401 and other.json()["code"] == "unauthenticated"
        by_path = httpx.post(
            f"{envd.sandbox_url}/sandboxes/{two.sandbox_id}/process.Process/List",
            content=body,
            headers={**headers, "E2b-Sandbox-Id": one.sandbox_id},
        )
        assert by_path.status_code == 403 and by_path.json()["code"] == "permission_denied"
        assert two.commands.run("echo fine").stdout == "fine\n"  # its own token works
    finally:
        one.kill()
        two.kill()


def test_bad_input_is_a_typed_error_that_changes_nothing(
    daemon: DaemonServer, envd: EnvdServer, opts: dict[str, Any]
) -> None:
    before = len(daemon.host.sandboxes)
    api = httpx.Client(base_url=envd.api_url, headers={"X-API-KEY": daemon.token or ""})
    with api:
        for body, field in [
            ({"templateID": "base", "timeout": -5}, "timeout"),
            ({"templateID": "base", "envVars": {"A": 1}}, "envVars"),
            ({"templateID": "base", "surprise": True}, "surprise"),
            ({"timeout": 10}, "templateID"),
        ]:
            answer = api.post("/v2/sandboxes", json=body)
            assert answer.status_code == 400, body
            assert answer.json()["code"] == 400 and field in answer.json()["message"]
        assert api.post("/v2/sandboxes", content=b"{not json").status_code == 400
        assert api.get("/v2/sandboxes", params={"limit": "0"}).status_code == 400
        assert api.get("/sandboxes/sbx-nosuch").status_code == 404
        assert api.post("/sandboxes/bad$id/pause").status_code == 404
    with pytest.raises(e2b.SandboxException, match="network is not served"):
        e2b.Sandbox.create(network={"deny_out": ["0.0.0.0/0"]}, **opts)
    assert len(daemon.host.sandboxes) == before

    sbx = e2b.Sandbox.create(**opts)
    try:
        with pytest.raises(e2b.SandboxException, match="filesystem-only pause"):
            sbx.pause(mode="filesystem")
        assert state_of(daemon, sbx.sandbox_id) == "running"
        with pytest.raises(e2b.SandboxException, match="400"):
            sbx.set_timeout(0)
        with pytest.raises(e2b.SandboxException, match=r"501: .*not served"):
            sbx.get_metrics()  # an E2B route sandboxkit does not serve: not "not found"
        assert sbx.commands.run("echo still").stdout == "still\n"  # the daemon serves on
    finally:
        sbx.kill()


# -- sandboxkit's E2B provider, cloud path ---------------------------------------------


@pytest.fixture
def cloud(daemon: DaemonServer, envd: EnvdServer) -> dict[str, Any]:
    """The provider's arguments for this daemon as E2B's cloud; the envd URL ends in
    ``/live``, so a reattach gets only new output, as from E2B's envd."""
    return {
        "provider": "e2b",
        "token": daemon.token,
        "provider_options": {"api_url": envd.api_url, "sandbox_url": f"{envd.sandbox_url}/live"},
    }


@pytest.fixture
def sbx(cloud: dict[str, Any]) -> Iterator[Sandbox]:
    client = Sandbox.create(timeout=120, **cloud)
    try:
        yield client
    finally:
        if client.info.state != "killed":
            client.kill()


def test_provider_cloud_pause_resume_kill(daemon: DaemonServer, sbx: Sandbox) -> None:
    sid = sbx.sandbox_id
    assert not sbx.async_sandbox.backend.debug and state_of(daemon, sid) == "running"
    lines: list[str] = []
    handle = sbx.commands.run(COUNTER, background=True, on_stdout=lines.append)
    wait_until(lambda: len(lines) > 20, what="lines")
    sbx.pause()
    assert state_of(daemon, sid) == "paused" and sbx.get_info().state == "paused"
    sbx.resume()
    assert state_of(daemon, sid) == "running" and sbx.get_info().state == "running"
    count = len(lines)
    wait_until(lambda: len(lines) > count + 50, what="lines after the resume")
    assert lines[0] == "begin" and lines[1:] == numbered(lines[1:]), "lost or duplicated"
    sbx.set_timeout(900)
    assert daemon.host.sandboxes[sid].timeout == 900
    kinds = [e["kind"] for e in sbx.raw_events()]
    assert "sandbox.paused" in kinds and "sandbox.resumed" in kinds
    assert handle.pid in {p.pid for p in sbx.commands.list()}
    sbx.kill()
    assert state_of(daemon, sid) == "killed"


@pytest.mark.timeout(60)
def test_panel_pause_resume_buttons_timeline_and_reattach(
    daemon: DaemonServer, sbx: Sandbox
) -> None:
    pid = sbx.commands.start(COUNTER).pid
    panel = ProcessPanel(sbx, pid)
    timeline = LifecycleTimeline(sbx)
    try:
        wait_until(lambda: panel.line_count >= 50, what="lines in the panel")
        panel.on_pause_resume()  # the Pause button
        assert state_of(daemon, sbx.sandbox_id) == "paused"
        panel.flush()
        assert panel.pause_button.description == "Resume" and "paused" in last_status(panel)
        panel.on_pause_resume()  # the Resume button
        assert state_of(daemon, sbx.sandbox_id) == "running"
        panel.flush()
        assert panel.pause_button.description == "Pause"

        panel.on_reattach()
        target = panel.line_count + 100
        wait_until(lambda: panel.line_count >= target, what="lines after the reattach")
        lines = panel.lines
        assert lines[0] == "begin" and lines[1:] == numbered(lines[1:]), "lost or duplicated"

        old = panel.pid
        panel.on_kill_restart()
        assert panel.pid != old and sbx.commands.get(panel.pid).restarted_from == old
        wait_until(lambda: panel.line_count >= 20, what="the new process's lines")

        timeline.refresh()
        kinds = [e["kind"] for e in timeline.events]
        assert {"sandbox.paused", "sandbox.resumed", "process.restarted"} <= set(kinds)
        assert kinds.index("sandbox.paused") < kinds.index("sandbox.resumed")
    finally:
        timeline.close()
        panel.close()
        sbx.commands.kill(panel.pid)


def test_dashboard_lists_connects_and_pauses_through_the_control_plane(
    daemon: DaemonServer, cloud: dict[str, Any]
) -> None:
    own = Sandbox.create(url=daemon.url, token=daemon.token)  # made outside the provider
    dashboard = SandboxDashboard(
        refresh_interval=None,
        provider="e2b",
        token=cloud["token"],
        provider_options=cloud["provider_options"],
    )
    try:
        dashboard.refresh()
        assert own.sandbox_id in dashboard.selector.options
        dashboard.select(own.sandbox_id)
        dashboard.on_pause()
        assert state_of(daemon, own.sandbox_id) == "paused"
        dashboard.on_resume()
        assert state_of(daemon, own.sandbox_id) == "running"
        assert dashboard.state.error is None
    finally:
        dashboard.close()
        own.kill()


async def test_provider_list_and_async_kill(daemon: DaemonServer, cloud: dict[str, Any]) -> None:
    sbx = await AsyncSandbox.create(**cloud)
    try:
        options = {"url": None, "token": cloud["token"], "options": cloud["provider_options"]}
        listed = {i.sandbox_id: i.state for i in await load("e2b").list_sandboxes(**options)}
        assert listed[sbx.sandbox_id] == "running"
        await sbx.pause()
        listed = {i.sandbox_id: i.state for i in await load("e2b").list_sandboxes(**options)}
        assert listed[sbx.sandbox_id] == "paused"
    finally:
        await sbx.kill()
    assert state_of(daemon, sbx.sandbox_id) == "killed"


def test_provider_create_passes_on_timeout_and_auto_resume_on(
    daemon: DaemonServer, cloud: dict[str, Any]
) -> None:
    before = set(daemon.host.sandboxes)
    with pytest.raises(ProviderUnsupported, match="on_timeout='pause'") as caught:
        Sandbox.create(auto_resume=True, **cloud)  # E2B resumes only what its timeout paused
    assert caught.value.operation == "auto_resume"
    assert set(daemon.host.sandboxes) == before, "a refused create made a sandbox"
    sbx = Sandbox.create(timeout=120, on_timeout="pause", auto_resume=True, **cloud)
    try:
        made = daemon.host.sandboxes[sbx.sandbox_id]
        assert (made.on_timeout, made.auto_resume) == ("pause", True)
        assert (sbx.info.on_timeout, sbx.info.auto_resume) == ("pause", True)
    finally:
        sbx.kill()
