"""Isolation: each sandboxed process in its own Linux namespaces, seeing E2B's file system.

A sandbox's process runs under bubblewrap (``bwrap``, Debian's ``bubblewrap``: what
Flatpak and Anthropic's sandbox-runtime use) in new user, mount, PID, IPC and UTS
namespaces, and a new network namespace with nothing but loopback when the sandbox has
no internet access. What it sees (``docs/isolation.md`` has the threat model):

* ``/home/user`` — the sandbox's working directory (its cwd and ``$HOME``);
* ``/tmp`` — the sandbox's own temporary directory, shared by its processes only;
* the host's system directories, read-only; a fresh ``/proc`` of its PID namespace and a
  minimal ``/dev``;
* nothing of ``/home``, ``/root``, ``/run``, ``/var/tmp``, the host's ``/tmp``, the
  daemon's user's home, state file or runtime root (each an empty tmpfs), except the
  Python installation the daemon runs on, read-only, so ``sys.executable`` works inside.

Why bubblewrap and not our own ``unshare``/``mount`` calls: bwrap is a small, audited C
program that does the fiddly parts (pivot_root, ``/proc`` and ``/dev`` inside a new PID
namespace, the uid map, no new privileges) the same way for every distribution that
ships Flatpak; the daemon stays pure Python and stays unprivileged.

Why one namespace set per *process* rather than per sandbox: every launch then starts
from the same plan with no long-lived helper to supervise, pause or recover, and the
freezer, kill and recovery see an ordinary process tree (orphans inside are reparented
to bwrap's init, a descendant of the launch). What the processes of one sandbox share is
what E2B users share between commands: ``/home/user`` and ``/tmp`` (bind mounts of host
directories, which is also how the files API reaches them) and, with internet access,
the host's network. Without it each process has its own loopback (documented).

A root daemon never runs sandboxed code as host root: inside a user namespace a process
whose host uid is 0 still passes owner permission checks on root's files (``/etc/shadow``
is root's), so processes run as :data:`SANDBOX_HOST_UID` (``nobody``), and the sandbox's
directories are given to that account. The daemon makes one user namespace in which
``user`` *is* ``nobody`` (:mod:`~sandboxkit.daemon.userns`), and each launch's bwrap
joins it (``--userns``): its other namespaces are still the launch's own, and bwrap
drops every capability before the command runs. What a user namespace keeps per user
and sandboxes could then share, the kernel's keyrings, every isolated process is refused
(:mod:`~sandboxkit.daemon.seccomp`). A launch as ``root`` inside, or where that namespace
cannot be made, drops to ``nobody`` with ``setpriv`` first and has bwrap make a user
namespace of its own: one exec (1.1 ms) more.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, NamedTuple

from sandboxkit.daemon.seccomp import filter_pipe, keyring_filter
from sandboxkit.errors import InvalidArgument, IsolationUnavailable

__all__ = [
    "HOME",
    "ISOLATION_ENV",
    "ISOLATION_MODES",
    "SANDBOX_HOST_UID",
    "TMP",
    "IsolationMode",
    "NamespacePlan",
    "Probe",
    "Wrapped",
    "drop_prefix",
    "hidden_defaults",
    "host_mounts",
    "probe",
    "resolve_mode",
    "sandbox_account",
    "write_accounts",
]

ISOLATION_ENV: Final = "SANDBOXKIT_ISOLATION"
"""The daemon's default isolation when its config does not name one (``DaemonConfig``)."""

IsolationMode = Literal["auto", "namespaces", "none"]
ISOLATION_MODES: Final = ("auto", "namespaces", "none")

HOME: Final = "/home/user"
"""The sandbox's working directory as its processes see it (E2B's)."""
TMP: Final = "/tmp"

USER_UID: Final = 1000
"""``user`` inside the namespace (E2B's default account)."""

SANDBOX_HOST_UID: Final = 65534
"""The host account a *root* daemon runs sandboxed processes as (``nobody``)."""

# Environment a sandboxed process gets from the daemon's own: enough for programs to
# behave (locale, terminal, search path), nothing that could carry a secret.
_PASS_ENV: Final = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TERM", "TZ")
_DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Host directories never shown inside (replaced by an empty tmpfs when they exist).
_HIDDEN: Final = ("/home", "/root", "/run", "/var/tmp", "/var/run", "/mnt", "/media", "/srv")


@dataclass(frozen=True)
class Probe:
    """Whether namespaces work here, and if not, what is missing."""

    available: bool
    reason: str = ""
    bwrap: str | None = None


@functools.cache
def probe() -> Probe:
    """Try bubblewrap once (a few ms): the answer holds for the daemon's lifetime."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Probe(False, "bubblewrap is not installed (the 'bwrap' program; Debian: bubblewrap)")
    argv = [
        bwrap,
        "--unshare-user",
        *_UNSHARE,
        "--unshare-net",
        "--ro-bind",
        "/",
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--",
        "true",
    ]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Probe(False, f"bubblewrap did not run: {exc}")
    if done.returncode == 0:
        return Probe(True, bwrap=bwrap)
    said = done.stderr.decode(errors="replace").strip().splitlines()
    return Probe(False, _why_not(said[-1] if said else f"exit {done.returncode}"))


def _why_not(said: str) -> str:
    """bwrap's complaint, with the kernel setting behind it when one is off."""
    knobs = ("/proc/sys/kernel/unprivileged_userns_clone", "/proc/sys/user/max_user_namespaces")
    for knob in knobs:
        try:
            if Path(knob).read_text().strip() == "0":
                return f"user namespaces are disabled ({knob[6:].replace('/', '.')} = 0): {said}"
        except OSError:
            continue
    return f"user namespaces are not available here: {said}"


def resolve_mode(asked: str) -> Literal["namespaces", "none"]:
    """What ``asked`` gives on this host: ``auto`` → namespaces when they work, else
    none; ``namespaces`` → namespaces or :class:`IsolationUnavailable` naming what is
    missing; ``none`` → none."""
    if asked not in ISOLATION_MODES:
        raise InvalidArgument(
            f"isolation must be one of {', '.join(ISOLATION_MODES)}, not {asked!r}",
            field="isolation",
        )
    if asked == "none":
        return "none"
    found = probe()
    if found.available:
        return "namespaces"
    if asked == "namespaces":
        raise IsolationUnavailable(
            f"isolation='namespaces' cannot be had here: {found.reason}", missing=found.reason
        )
    return "none"


_UNSHARE: Final = ("--unshare-pid", "--unshare-ipc", "--unshare-uts")
"""The namespaces every launch makes besides its user namespace (and network's)."""


class Wrapped(NamedTuple):
    """One launch under bubblewrap (see :meth:`NamespacePlan.wrap`)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    pass_fds: tuple[int, ...]
    own_fds: tuple[int, ...]
    """The launch's own descriptors among ``pass_fds`` (its seccomp filter's pipe)."""

    def close(self) -> None:
        """Close the launch's own descriptors (bwrap has its copies once spawned)."""
        for fd in self.own_fds:
            os.close(fd)


@dataclass(frozen=True)
class NamespacePlan:
    """How one sandbox's processes are wrapped: its two host directories, what to hide,
    and whether it has the host's network."""

    home: Path
    """The sandbox's working directory, mounted at :data:`HOME`."""
    tmp: Path
    """The sandbox's temporary directory, mounted at :data:`TMP`."""
    etc: Path
    """Holds the ``passwd`` and ``group`` the sandbox sees (see :func:`write_accounts`)."""
    hide: tuple[str, ...]
    """Host directories replaced by an empty tmpfs, besides :data:`_HIDDEN`."""
    internet: bool
    hostname: str
    bwrap: str
    prefix: tuple[str, ...] = ()
    """Run before bwrap (after the cgroup and limits wrapper): for a root daemon, the
    drop to :data:`SANDBOX_HOST_UID`."""
    userns: int | None = None
    """For a root daemon, the user namespace a launch as ``user`` joins (see
    :mod:`~sandboxkit.daemon.userns`): then no ``prefix``, and no user namespace of its
    own."""

    def wrap(self, user: str | None, cwd: str | None) -> Wrapped:
        """For one launch: the argv to put before the command, the base environment, the
        host directory to start bwrap in and the descriptors it must inherit (close the
        launch's own with :meth:`Wrapped.close` once it is spawned). ``user`` is ``user``
        (the default) or ``root`` (root inside the namespace only); InvalidArgument for
        any other."""
        account = sandbox_account(user)
        inside, backing = self.inside_path(cwd)
        env = self.env(account)
        cwd_host = str(backing or self.home)
        head: tuple[str, ...] = self.prefix
        options, inherited = ["--unshare-user"], []
        if account == "user" and self.userns is not None:
            # As nobody already (see sandboxkit/daemon/userns.py): no drop before bwrap.
            head, options, inherited = (), ["--userns", str(self.userns)], [self.userns]
        own: tuple[int, ...] = ()
        program = keyring_filter()
        if program is not None:
            own = (filter_pipe(program),)
            options += ["--seccomp", str(own[0])]
        argv = [*head, *self._head(options), *self.argv(inside, account)]
        return Wrapped(argv, env, cwd_host, (*inherited, *own), own)

    def inside_path(self, cwd: str | None) -> tuple[str, Path | None]:
        """``cwd`` as the process sees it, and the host directory that backs it (``None``
        for a read-only system directory). Relative paths are relative to ``/home/user``.
        InvalidArgument unless the directory exists and is visible inside."""
        inside = os.path.normpath(os.path.join(HOME, cwd or ""))
        for mount, host in ((HOME, self.home), (TMP, self.tmp)):
            if inside == mount or inside.startswith(mount + "/"):
                backing = host / os.path.relpath(inside, mount)
                if not backing.is_dir():
                    raise InvalidArgument(
                        f"cwd {inside} does not exist in the sandbox"
                        + ("" if cwd and cwd.startswith("/") else " (relative to /home/user)"),
                        field="cwd",
                    )
                return inside, backing
        if _under(inside, (*_HIDDEN, *self.hide, "/proc", "/dev", "/sys")):
            raise InvalidArgument(f"cwd {inside} is not visible inside the sandbox", field="cwd")
        if not os.path.isdir(inside):
            raise InvalidArgument(f"cwd {inside} does not exist in the sandbox", field="cwd")
        return inside, None

    def env(self, user: str) -> dict[str, str]:
        """The base environment of a sandboxed process (then the sandbox's and the
        request's variables go on top)."""
        env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
        env.setdefault("PATH", _DEFAULT_PATH)
        home = "/root" if user == "root" else HOME
        env.update(HOME=home, USER=user, LOGNAME=user, TMPDIR=TMP)
        return env

    def _head(self, options: list[str]) -> list[str]:
        """``bwrap``, its user namespace and filter (``options``) and the namespaces it
        makes."""
        net = () if self.internet else ("--unshare-net",)
        return [self.bwrap, *options, *_UNSHARE, *net]

    def argv(self, cwd_inside: str, user: str) -> list[str]:
        """``bwrap``'s options after its namespaces, ending in ``--``: put the command's
        argv after it."""
        uid = str(0 if user == "root" else USER_UID)
        mounts, accounts = self._options
        root_home = ["--dir", "/root"] if user == "root" else []
        return ["--uid", uid, "--gid", uid, *mounts, *root_home, *accounts,
                "--chdir", cwd_inside, "--"]  # fmt: skip

    @functools.cached_property
    def _options(self) -> tuple[list[str], list[str]]:
        """The options every launch of this sandbox shares (the mounts, the account
        files), worked out once: finding which host directories exist and which the
        dropped account can reach took most of a millisecond per launch. What a launch
        sees is fixed when its sandbox is made, as its ``hide`` list is."""
        mounts = ["--hostname", self.hostname]
        mounts += ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
        tmpfs, keep = host_mounts(self.hide, bool(self.prefix))
        for place in tmpfs:
            mounts += ["--tmpfs", place]
        mounts += ["--bind", str(self.home), HOME, "--bind", str(self.tmp), TMP]
        for place in keep:
            mounts += ["--ro-bind", place, place]
        accounts: list[str] = []
        for name in ("passwd", "group"):
            accounts += ["--ro-bind", str(self.etc / name), f"/etc/{name}"]
        # No --clearenv: bwrap passes on its own environment, which the daemon builds
        # from :meth:`env` alone (nothing of the daemon's own environment leaks in).
        return mounts, accounts


@functools.cache
def host_mounts(hide: tuple[str, ...], dropped: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The host directories to cover with an empty tmpfs, and the interpreter's
    directories to bind back read-only, for a daemon that hides ``hide`` (and drops to
    :data:`SANDBOX_HOST_UID` if ``dropped``). Worked out once per daemon (the directories
    of the host and of the daemon's Python do not come and go; a look at each took most of
    a millisecond of a sandbox's first launch); the host warms it when it starts."""
    covered = (*_HIDDEN, *hide)
    hidden = _existing_dirs(covered)
    # Each mount costs bwrap time: none below /tmp (replaced whole) or below another
    # hidden place.
    tmpfs = tuple(p for p in hidden if not _under(p, (TMP, *(h for h in hidden if h != p))))
    # The daemon's interpreter stays usable inside (it may live in a hidden home, or in a
    # venv under the host's /tmp), where the account the sandbox runs as can reach it.
    keep = tuple(
        p
        for p in _existing_dirs(_python_dirs())
        if _under(p, (*covered, TMP)) and (not dropped or _world_reachable(p))
    )
    return tmpfs, keep


def sandbox_account(user: str | None) -> str:
    """The account a process of an isolated sandbox runs as inside: ``user`` (the
    default, also for ``None`` and ``""``) or ``root``; InvalidArgument for any other."""
    if user in (None, "", "user"):
        return "user"
    if user == "root":
        return "root"
    raise InvalidArgument(
        f"an isolated sandbox runs processes as 'user' or 'root' (inside its namespace), "
        f"not {user!r}",
        field="user",
    )


@functools.cache
def drop_prefix() -> tuple[str, ...]:
    """For a root daemon, the argv that drops to :data:`SANDBOX_HOST_UID` before bwrap
    (``setpriv``, util-linux); nothing for any other daemon. Looked up once (a walk of
    ``PATH`` on every create otherwise)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    ids = (str(SANDBOX_HOST_UID), str(SANDBOX_HOST_UID))
    if setpriv is not None:
        return (setpriv, f"--reuid={ids[0]}", f"--regid={ids[1]}", "--clear-groups", "--")
    drop = (
        "import os,sys;os.setgroups([]);os.setgid(65534);os.setuid(65534);"
        "os.execvp(sys.argv[1],sys.argv[1:])"
    )
    return (sys.executable, "-I", "-S", "-c", drop)


def hidden_defaults(*roots: Path) -> tuple[str, ...]:
    """Host places of the daemon's own to hide besides :data:`_HIDDEN`: its ``roots``
    (sandboxes' directories, output logs), its user's home, its runtime and temp
    directories, and its state file's directory."""
    places = [*map(str, roots), os.path.expanduser("~"), tempfile.gettempdir()]
    for var in ("XDG_RUNTIME_DIR", "SANDBOXKIT_STATE_FILE"):
        value = os.environ.get(var)
        if value:
            places.append(value if var == "XDG_RUNTIME_DIR" else os.path.dirname(value))
    return tuple(p for p in places if os.path.isabs(p))


def _world_reachable(path: str) -> bool:
    """Whether any account can get to ``path`` (every directory on the way searchable by
    others): what ``nobody`` can bind, when a root daemon drops to it."""
    while True:
        try:
            if not os.stat(path).st_mode & 0o001:
                return False
        except OSError:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _under(path: str, places: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in places)


def _existing_dirs(paths: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for path in paths:
        real = os.path.realpath(path)
        if os.path.isdir(real) and real != "/" and real not in seen:
            seen.append(real)
    return seen


def _python_dirs() -> tuple[str, ...]:
    """The daemon's Python: its prefixes and the directory of the real interpreter."""
    return (
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
    )


def write_accounts(etc: Path) -> None:
    """``passwd`` and ``group`` for inside: the host's system accounts, with ``user``
    (uid 1000, home ``/home/user``) in place of whatever account has uid 1000 here."""
    etc.mkdir(parents=True, exist_ok=True)
    for name, line in (
        ("passwd", f"user:x:{USER_UID}:{USER_UID}:user:{HOME}:/bin/bash"),
        ("group", f"user:x:{USER_UID}:"),
    ):
        try:
            host = Path("/etc", name).read_text().splitlines()
        except OSError:
            host = ["root:x:0:0:root:/root:/bin/sh" if name == "passwd" else "root:x:0:"]
        kept = [
            entry
            for entry in host
            if entry.count(":") >= 2
            and entry.split(":")[2] != str(USER_UID)
            and entry.split(":")[0] != "user"
        ]
        (etc / name).write_text("\n".join([*kept, line]) + "\n")
        os.chmod(etc / name, 0o644)
