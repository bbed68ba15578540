"""A loopback smart-HTTP git server for one test: http.server in a thread, git-http-backend as CGI.

Started and stopped by the test (a context manager), bound to 127.0.0.1 on a free port,
every CGI run bounded by a timeout.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

BACKEND = Path("/usr/lib/git-core/git-http-backend")
_CGI_SECONDS = 60.0


def _handler(root: Path, env: dict[str, str]) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._cgi()

        def do_POST(self) -> None:
            self._cgi()

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":  # git's large pushes
                out = bytearray()
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    out += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return bytes(out)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _cgi(self) -> None:
            url = urlsplit(self.path)
            body = self._body() if self.command == "POST" else b""
            cgi = {
                **env,
                "GIT_PROJECT_ROOT": str(root),
                "GIT_HTTP_EXPORT_ALL": "1",
                "REQUEST_METHOD": self.command,
                "PATH_INFO": url.path,
                "QUERY_STRING": url.query,
                "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                "CONTENT_LENGTH": str(len(body)),
                "REMOTE_USER": "tester",
                "REMOTE_ADDR": "127.0.0.1",
            }
            for name, value in self.headers.items():  # Git-Protocol, Content-Encoding: HTTP_*
                cgi["HTTP_" + name.upper().replace("-", "_")] = value
            done = subprocess.run(
                [str(BACKEND)], input=body, env=cgi, capture_output=True, timeout=_CGI_SECONDS, check=False
            )
            head, _, payload = done.stdout.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = next(
                (line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("status:")), "200"
            )
            code, _, reason = status.partition(" ")
            self.send_response(int(code), reason or None)
            for line in lines:
                name, _, value = line.partition(":")
                if name and name.lower() != "status":
                    self.send_header(name, value.strip())
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def serve(root: Path, env: dict[str, str]) -> Iterator[str]:
    """Serve the bare repos under ``root``; yields ``http://127.0.0.1:PORT``."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(root, env))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def available() -> bool:
    return os.access(BACKEND, os.X_OK)
