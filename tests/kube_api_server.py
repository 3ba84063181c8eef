"""A tiny stand-in for the Kubernetes API server: just the custom-objects REST paths.

No API server can run on these machines, so the client is tested against this:
the ``kubernetes`` package and HTTP are real; this server stores ray.io/v1
objects in memory, answers like the API server does (201/200, and a ``Status``
body with 404/409/403/401/422), applies the CRD schema's defaults, and refuses
objects that fail the schema. ``set_status`` plays the KubeRay operator.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pathways_ray.kuberay.schema import SchemaError, validate

PLURAL_KIND = {"rayclusters": "RayCluster", "rayjobs": "RayJob", "rayservices": "RayService"}
_PATH = re.compile(r"^/apis/ray\.io/v1/namespaces/([^/]+)/([^/?]+)(?:/([^/?]+))?/?(?:\?.*)?$")


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class KubeApiServer:
    def __init__(self, token: str | None = None, forbidden_namespaces: tuple[str, ...] = ()):
        self.token = token
        self.forbidden = set(forbidden_namespaces)
        self.objects: dict[tuple[str, str, str], dict] = {}  # (plural, ns, name) -> object
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> KubeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def set_status(self, plural: str, namespace: str, name: str, status: dict) -> None:
        with self._lock:
            self.objects[(plural, namespace, name)]["status"] = status

    # ---- HTTP -----------------------------------------------------------------
    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                server.requests.append((self.command, self.path))
                if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
                    self._send(401, _status(401, "Unauthorized", "Unauthorized"))
                    return None
                m = _PATH.match(self.path)
                if not m or m.group(2) not in PLURAL_KIND:
                    self._send(404, _status(404, "NotFound", f"the server could not find the "
                                            f"requested resource {self.path}"))
                    return None
                ns, plural, name = m.groups()
                if ns in server.forbidden:
                    self._send(403, _status(403, "Forbidden", f'{plural}.ray.io is forbidden: '
                                            f'cannot {self.command} in namespace "{ns}"'))
                    return None
                return ns, plural, name

            def do_GET(self):
                route = self._route()
                if route is None:
                    return
                ns, plural, name = route
                with server._lock:
                    if name is None:
                        items = [o for (p, n, _), o in sorted(server.objects.items())
                                 if p == plural and n == ns]
                        self._send(200, {"apiVersion": "ray.io/v1",
                                         "kind": PLURAL_KIND[plural] + "List",
                                         "metadata": {"resourceVersion": "1"}, "items": items})
                        return
                    obj = server.objects.get((plural, ns, name))
                if obj is None:
                    self._send(404, _status(404, "NotFound",
                                            f'{plural}.ray.io "{name}" not found'))
                else:
                    self._send(200, obj)

            def do_POST(self):
                route = self._route()
                if route is None:
                    return
                ns, plural, name = route
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if name is not None or body.get("kind") != PLURAL_KIND[plural]:
                    self._send(400, _status(400, "BadRequest",
                                            f"kind {body.get('kind')!r} does not match {plural}"))
                    return
                try:
                    obj = validate(body)
                except SchemaError as e:
                    self._send(422, _status(422, "Invalid", str(e)))
                    return
                meta = obj["metadata"]
                meta.setdefault("namespace", ns)
                if meta["namespace"] != ns:
                    self._send(400, _status(400, "BadRequest", "namespace does not match"))
                    return
                key = (plural, ns, meta["name"])
                with server._lock:
                    if key in server.objects:
                        self._send(409, _status(409, "AlreadyExists",
                                                f'{plural}.ray.io "{meta["name"]}" already exists'))
                        return
                    meta.update(uid=str(uuid.uuid4()), resourceVersion=str(len(server.requests)),
                                creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                generation=1)
                    server.objects[key] = obj
                self._send(201, obj)

            def do_DELETE(self):
                route = self._route()
                if route is None:
                    return
                ns, plural, name = route
                with server._lock:
                    obj = server.objects.pop((plural, ns, name), None)
                if obj is None:
                    self._send(404, _status(404, "NotFound", f'{plural}.ray.io "{name}" not found'))
                else:
                    self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success",
                                     "details": {"name": name, "kind": plural}})

        return Handler
