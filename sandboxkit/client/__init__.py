"""The client SDK: async and sync sandboxes, commands and streams."""

from sandboxkit.client.api import ApiClient
from sandboxkit.client.commands import AsyncCommandHandle, AsyncCommands
from sandboxkit.client.options import ConnectOptions, FollowOptions, RunOptions, StartOptions
from sandboxkit.client.output import Cursor
from sandboxkit.client.results import (
    CommandResult,
    Failed,
    Ok,
    Outcome,
    ProcessInfo,
    SandboxInfo,
    attempt,
)
from sandboxkit.client.sandbox import AsyncSandbox
from sandboxkit.client.stdin import HttpStdinTransport, StdinSession, StdinTransport
from sandboxkit.client.stream import GapInfo, ProcessStream, StreamStats
from sandboxkit.client.sync import CommandHandle, Commands, Sandbox

__all__ = [
    "ApiClient",
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncSandbox",
    "CommandHandle",
    "CommandResult",
    "Commands",
    "ConnectOptions",
    "Cursor",
    "Failed",
    "FollowOptions",
    "GapInfo",
    "HttpStdinTransport",
    "Ok",
    "Outcome",
    "ProcessInfo",
    "ProcessStream",
    "RunOptions",
    "Sandbox",
    "SandboxInfo",
    "StartOptions",
    "StdinSession",
    "StdinTransport",
    "StreamStats",
    "attempt",
]
