"""An HTTP proxy in front of the S3-compatible test server that injects faults: the first N GETs
of objects whose path matches a pattern get `503 SlowDown` (or the connection is dropped). Every
request is logged (method, path, status) to a file the test reads.

    python tests/s3_proxy.py --target http://127.0.0.1:PORT --port 0 --fail REGEX --times 2 --log FILE --ready FILE
"""

from __future__ import annotations

import argparse
import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

SLOW_DOWN = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>'


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--fail", default="")
    ap.add_argument("--times", type=int, default=0)
    ap.add_argument("--mode", choices=["503", "drop"], default="503")
    ap.add_argument("--log", required=True)
    ap.add_argument("--ready", required=True)
    a = ap.parse_args()
    target = urlsplit(a.target)
    pattern = re.compile(a.fail) if a.fail else None
    failed: dict[str, int] = {}
    lock = threading.Lock()
    log = open(a.log, "a", encoding="utf-8", buffering=1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _forward(self) -> None:
            body = self._body()
            path = self.path.split("?", 1)[0]
            if self.command == "GET" and pattern is not None and pattern.search(path):
                with lock:
                    n = failed.get(path, 0)
                    inject = n < a.times
                    if inject:
                        failed[path] = n + 1
                if inject:
                    log.write(f"{self.command} {path} injected-{a.mode}\n")
                    if a.mode == "drop":
                        self.close_connection = True
                        self.connection.close()
                        return
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "content-length")}
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            log.write(f"{self.command} {path} {resp.status}\n")
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "content-length", "connection", "server", "date"):
                    self.send_header(k, v)
            # A HEAD answer has no body but the length of the object (what a client reads its size from).
            self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            conn.close()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    server = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    # Whole or absent: the test polls for this file, and a read between its creation and its write saw no port.
    partial = Path(a.ready + ".part")
    partial.write_text(str(server.server_address[1]))
    partial.replace(a.ready)
    server.serve_forever()


if __name__ == "__main__":
    main()
