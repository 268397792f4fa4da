"""A static file server for the remote-store tests: `python http_store.py ROOT PORT_FILE [--delay-per-mib S]`.

Serves ROOT on 127.0.0.1 (`--port`, default a free one; written to PORT_FILE once listening) with Python's
ThreadingHTTPServer.
Every GET is logged to stdout as `GET <path> <status>` (flushed) when its answer starts, and `LAST <path>` just
before the last bytes of its body are sent (no client can hold a whole body before its LAST line), so a test counts
the requests the server answered and sees which overlapped.
A path containing `forbidden` answers 403. `--delay-per-mib` sends bodies slowly (a download in flight a test can
kill). `Range: bytes=A-B` is answered 206 with those bytes (logged `GET <path> 206`, no LAST line), unless
`--no-ranges`: then with the whole file, as Python's http.server does; `--range-delay S` waits S seconds first.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Server(ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128  # socketserver's 5 drops the SYNs of a client's parallel range GETs (1 s retries)


class Handler(SimpleHTTPRequestHandler):
    delay_per_mib = 0.0
    ranges = True
    range_delay = 0.0

    def do_GET(self) -> None:
        if "forbidden" in self.path:
            self.send_error(403, "Forbidden")
            return
        wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if wanted and self.ranges:
            self.send_range(int(wanted[1]), int(wanted[2]))
            return
        super().do_GET()

    def send_range(self, first: int, last: int) -> None:
        """206 with bytes first..last (inclusive) of the file, as S3 and nginx answer `Range: bytes=first-last`."""
        path = Path(self.translate_path(self.path))
        try:
            size = path.stat().st_size
        except OSError:
            self.send_error(404, "Not Found")
            return
        if first >= size or last < first:
            self.send_error(416, "Range Not Satisfiable")
            return
        last = min(last, size - 1)
        time.sleep(self.range_delay)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Length", str(last - first + 1))
        self.end_headers()
        with open(path, "rb") as f:
            f.seek(first)
            self.wfile.write(f.read(last - first + 1))  # no LAST line: that marks whole files sent

    def copyfile(self, source, outputfile) -> None:  # type: ignore[no-untyped-def]
        chunk = source.read(64 << 10)
        while chunk:
            following = source.read(64 << 10)
            if self.delay_per_mib:
                time.sleep(self.delay_per_mib / 16)
            if not following:  # logged before the last bytes go: no client can hold the whole body earlier
                sys.stdout.write(f"LAST {self.path}\n")
                sys.stdout.flush()
            outputfile.write(chunk)
            chunk = following

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        sys.stdout.write(f"{self.command} {self.path} {code}\n")
        sys.stdout.flush()

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("port_file", type=Path)
    parser.add_argument("--delay-per-mib", type=float, default=0.0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--no-ranges", action="store_true", help="answer a Range request with the whole file (200)")
    parser.add_argument("--range-delay", type=float, default=0.0, help="seconds before answering a Range request")
    args = parser.parse_args()
    Handler.delay_per_mib, Handler.range_delay = args.delay_per_mib, args.range_delay
    Handler.ranges = not args.no_ranges
    server = Server(("127.0.0.1", args.port), functools.partial(Handler, directory=str(args.root)))
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.rename(args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
