"""What our HTTP services share: JSON replies and the serve-until-Ctrl-C loop."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JSONHandler(BaseHTTPRequestHandler):
    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(server: ThreadingHTTPServer, banner: str) -> int:
    """Print `banner` with the bound address put in for `{url}`, then serve until Ctrl-C."""
    host, port = server.server_address[:2]
    print(banner.format(url=f"http://{host}:{port}"), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
