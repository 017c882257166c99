"""A local S3 endpoint for tests and benchmarks: moto's ``ThreadedMotoServer`` on 127.0.0.1.

:class:`LocalS3` starts moto's server on a free loopback port with a thin WSGI layer in
front of it that counts requests and plays a misbehaving store when asked: it answers a
request that matches a pattern with an error, holds it, or SIGKILLs given processes first.
Clients (``s3fs``/``botocore`` in this process and in spawned ranks, OLMo-core's ``boto3``)
reach it through the environment a user would set (:attr:`LocalS3.env`: ``AWS_ENDPOINT_URL``
and dummy credentials); nothing in the library is patched. Spawned ranks plant failures
over HTTP (:func:`plant`), since the server lives in the process that started it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>planted by the '
    "test</Message></Error>"
)


@dataclass
class Fault:
    """Answer the next ``times`` requests whose ``"<METHOD> <path>?<query>[ range]"`` matches
    ``pattern`` (after letting ``skip`` of them through): ``fail`` with ``status`` (an S3
    error), ``hold`` until released (or ``seconds``), or ``kill`` the ``pids`` (SIGKILL)
    and then hold."""

    pattern: str
    action: str = "fail"
    status: int = 403
    times: int = 1
    skip: int = 0
    seconds: float = 60.0
    pids: list[int] = field(default_factory=list)
    seen: int = 0


class LocalS3:
    """moto's S3 server on ``127.0.0.1:<free port>`` with the layer above; a context
    manager (started on enter, stopped on exit)."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.faults: list[Fault] = []
        self.held = threading.Event()  # set while a request is held
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._server: Any = None

    # ------------------------------------------------------------------ life
    def __enter__(self) -> LocalS3:
        from moto.server import DomainDispatcherApplication, ThreadedMotoServer, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        store = self

        class Server(ThreadedMotoServer):
            def _server_entry(self) -> None:  # moto's, with the layer in front
                app = DomainDispatcherApplication(create_backend_app)
                self._server = make_server(self._ip_address, self._port, store._layer(app), True)
                self._server_ready_event.set()
                self._server.serve_forever()

        self._server = Server(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self._server.stop()

    @property
    def endpoint(self) -> str:
        host, port = self._server.get_host_and_port()
        return f"http://{host}:{port}"

    @property
    def env(self) -> dict[str, str]:
        """What a user sets to reach this store (botocore reads it when a client is made)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    # ------------------------------------------------------------------ faults
    def plant(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)
        self.release.clear()

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
        self.release.set()
        self.held.clear()

    def count(self, pattern: str = "") -> int:
        with self._lock:
            return sum(1 for r in self.requests if re.search(pattern, r))

    def _layer(self, app: Any) -> Any:
        def layer(environ: dict[str, Any], start_response: Any) -> Any:
            query = environ.get("QUERY_STRING", "")
            request = f"{environ['REQUEST_METHOD']} {environ.get('PATH_INFO', '')}?{query}"
            request += " range" if environ.get("HTTP_RANGE") else ""  # a byte-range read
            if environ.get("PATH_INFO", "").startswith("/_test/"):
                return self._control(environ, start_response)
            with self._lock:
                self.requests.append(request)
                fault = next((f for f in self.faults if re.search(f.pattern, request)), None)
                if fault is not None:
                    fault.seen += 1
                    if fault.seen >= fault.skip + fault.times:
                        self.faults.remove(fault)
                    if fault.seen <= fault.skip:
                        fault = None
            if fault is None:
                return app(environ, start_response)
            if fault.action == "hold":
                self.held.set()
                self.release.wait(fault.seconds)
                return app(environ, start_response)
            length = int(environ.get("CONTENT_LENGTH") or 0)
            environ["wsgi.input"].read(length)  # drain the body: the connection stays sane
            for pid in fault.pids:
                os.kill(pid, signal.SIGKILL)
            if fault.action == "kill":
                self.held.set()
                self.release.wait(fault.seconds)
            code = {403: "AccessDenied", 404: "NoSuchKey"}.get(fault.status, "ServiceUnavailable")
            body = ERROR_XML.format(code=code).encode()
            start_response(
                f"{fault.status} Planted", [("Content-Type", "application/xml"),
                                            ("Content-Length", str(len(body)))],
            )  # fmt: skip
            return [] if environ["REQUEST_METHOD"] == "HEAD" else [body]

        return layer

    def _control(self, environ: dict[str, Any], start_response: Any) -> Any:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        payload = json.loads(environ["wsgi.input"].read(length) or b"{}")
        body = b""
        if environ["PATH_INFO"] == "/_test/plant":
            self.plant(Fault(**payload))
        elif environ["PATH_INFO"] == "/_test/clear":
            self.clear()
        elif environ["PATH_INFO"] == "/_test/requests":
            with self._lock:
                body = json.dumps(self.requests).encode()
        start_response("200 OK", [("Content-Length", str(len(body)))])
        return [body]


def plant(endpoint: str, **fault: Any) -> None:
    """Plant a :class:`Fault` in the store at ``endpoint`` (from any process)."""
    _post(endpoint, "plant", fault)


def clear(endpoint: str) -> None:
    """Remove every planted fault, release held requests."""
    _post(endpoint, "clear", {})


def requests(endpoint: str) -> list[str]:
    """Every request the store at ``endpoint`` answered so far: ``"<METHOD> <path>?<query>"``,
    and ``" range"`` for a byte-range read."""
    return json.loads(_post(endpoint, "requests", {}))


def _post(endpoint: str, what: str, payload: dict[str, Any]) -> bytes:
    request = urllib.request.Request(
        f"{endpoint}/_test/{what}", data=json.dumps(payload).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def make_bucket(name: str) -> None:
    """Create bucket ``name`` with the client a user has (s3fs)."""
    import fsspec

    fsspec.filesystem("s3").mkdir(name)


@contextmanager
def serving_bucket(bucket: str) -> Iterator[LocalS3]:
    """A :class:`LocalS3` holding ``bucket``, with this process's S3 environment pointing
    at it (restored on exit) and s3fs's cached clients dropped on entry and exit, so no
    client of another endpoint is reused: the body of the test modules' ``store`` fixture."""
    import pytest
    import s3fs

    with pytest.MonkeyPatch.context() as mp, LocalS3() as s3:
        for k, v in s3.env.items():
            mp.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        make_bucket(bucket)
        yield s3
    s3fs.S3FileSystem.clear_instance_cache()
