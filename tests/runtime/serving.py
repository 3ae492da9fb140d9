"""A real deepinfer-serve process on a free port, for the server tests."""

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

API_KEY = "sk-test"


class Served:
    def __init__(self, bundle: Path, *args: str, api_key: str | None = API_KEY):
        """Native regions are allowed (the tests' own bundles) unless `args` say otherwise."""
        key = ["--api-key", api_key] if api_key else []
        if "--native-regions" not in args:
            args = (*args, "--native-regions", "allow")
        self.process = subprocess.Popen([sys.executable, "-m", "deepinfer.runtime.serve.cli", "--bundle", str(bundle),
                                         "--port", "0", *key, *args], stderr=subprocess.PIPE, text=True)
        line = self.process.stderr.readline()  # "listening on http://127.0.0.1:PORT ..."
        match = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if not match:
            self.process.kill()
            raise AssertionError(f"deepinfer-serve did not start: {line}{self.process.stderr.read()}")
        self.url = match.group(1)
        self.log: list[str] = [line]  # its stderr, read as it comes (a full pipe would stall the server)
        self.reader = threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True)
        self.reader.start()
        deadline = time.monotonic() + 120
        while self.health()[0] != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                self.reader.join(10)
                raise AssertionError(f"deepinfer-serve did not become ready: {''.join(self.log)}")
            time.sleep(0.1)

    def health(self) -> tuple[int, dict]:
        return get(f"{self.url}/health")

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as reply:
            text = reply.read().decode()
        return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> tuple[int, str]:
        """Send `sig` (None: none, it is stopping already) and wait for the exit code and stderr."""
        if sig is not None and self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        self.reader.join(timeout)
        return self.process.returncode, "".join(self.log)

    def children(self) -> list[int]:
        """The server's child processes (spawned followers), whichever of its threads started them."""
        return [int(p) for task in Path(f"/proc/{self.process.pid}/task").iterdir()
                for p in (task / "children").read_text().split()]


def get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    return request("GET", url, None, headers)


def request(method: str, url: str, body, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body or {}) of one HTTP request; `body` is a dict (sent as JSON) or bytes."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as reply:
            status, raw, out_headers = reply.status, reply.read(), reply.headers
    except urllib.error.HTTPError as err:
        status, raw, out_headers = err.code, err.read(), err.headers
    except urllib.error.URLError as err:
        return 0, {"error": {"message": str(err.reason)}}
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = {}
    if isinstance(payload, dict):
        payload["_headers"] = {k.lower(): v for k, v in out_headers.items()}
    return status, payload
