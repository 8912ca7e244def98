"""``sandboxkit serve --envd``, as a person runs it: the printed envd URL is what the
official e2b SDK needs, and the daemon still stops cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from e2b import Sandbox as E2BSandbox


def _envd_url(output: Path, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(r"envd endpoint for the e2b SDK: (\S+)", output.read_text())
        if found:
            return found.group(1)
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no envd URL printed: {output.read_text()}")
        time.sleep(0.02)  # sleep-ok: poll interval


def test_serve_envd_prints_the_url_the_sdk_uses(tmp_path: Path) -> None:
    output = tmp_path / "serve.out"
    env = {**os.environ, "SANDBOXKIT_STATE_FILE": str(tmp_path / "daemon.json")}
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandboxkit", "serve", "--envd", "0"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = _envd_url(output, proc)
        assert url.startswith("http://127.0.0.1:") and "/k/" in url
        sbx = E2BSandbox.create(debug=True, sandbox_url=url)
        assert sbx.commands.run("echo from-cli").stdout == "from-cli\n"
        # The control plane's line: the plain SDK, outside debug mode, with these settings.
        line = re.search(r"E2B API for the e2b SDK: (.*)", output.read_text())
        assert line is not None, output.read_text()
        env_vars = dict(pair.split("=", 1) for pair in line.group(1).split())
        cloud = E2BSandbox.create(
            api_key=env_vars["E2B_API_KEY"],
            api_url=env_vars["E2B_API_URL"],
            sandbox_url=env_vars["E2B_SANDBOX_URL"],
        )
        assert cloud.commands.run("echo from-api").stdout == "from-api\n"
        assert cloud.pause() and cloud.connect() and cloud.kill()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
