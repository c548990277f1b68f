"""A `dresd serve` process on 127.0.0.1, for tests, benchmarks and notebooks.

    with LocalServer(["--method", "pld", "--threads", "1"]) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

It picks a free port, waits until /health answers, and always stops the process (SIGINT, as
Ctrl-C would, then SIGKILL if it hangs). Its log is kept in `server.log_path`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalServer:
    def __init__(self, args: list[str], startup_timeout: float = 300.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.startup_timeout = startup_timeout
        self.env = env
        self.process: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="dresd-serve-", suffix=".log")[1])

    def start(self) -> LocalServer:
        command = [sys.executable, "-m", "dresd.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(self.port), *self.args]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL,
                                            env={**os.environ, **(self.env or {})})
        return self

    def wait_ready(self) -> LocalServer:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dresd serve exited with {self.process.returncode}:\n"
                                   f"{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"dresd serve did not answer within {self.startup_timeout:.0f} s:\n"
                           f"{self.log()[-3000:]}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def __enter__(self) -> LocalServer:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
