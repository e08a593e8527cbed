"""A STAND-IN for the Hugging Face Hub, not the Hub: it answers only the HTTP calls that
`HfApi.create_repo` and `HfApi.upload_folder` of huggingface_hub 2.x make, and keeps what they send.

It answers every file's upload mode with "regular", so the files come inline (base64) in the commit:
the Hub's LFS and Xet storage, which takes large files such as model.safetensors there, is not stood
in for, nor are tokens checked (the Authorization header is only recorded). What a test learns from
it: the export asks for the repo it was given and commits the folder's exact bytes to it.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class HubStandIn(ThreadingHTTPServer):
    """`with HubStandIn() as hub:` serves on 127.0.0.1 (a free port) at `hub.url` until the block ends."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos: dict[str, dict[str, bytes]] = {}  # repo id: {path in repo: bytes committed}
        self.calls: list[str] = []  # "POST /api/repos/create", ...
        self.authorization: set[str] = set()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: HubStandIn

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.calls.append(f"POST {path}")
        self.server.authorization.add(self.headers.get("Authorization", ""))
        if path == "/api/repos/create":
            return self._create(json.loads(body))
        if path == "/api/validate-yaml":  # only without hf_xet: the single-commit path checks the card
            return self._answer(200, {"errors": [], "warnings": []})
        found = re.fullmatch(r"/api/models/(.+)/(preupload|commit)/main", path)
        if found is None or found.group(1) not in self.server.repos:
            return self._answer(404, {"error": f"the stand-in has no {path}"})
        if found.group(2) == "preupload":
            return self._preupload(json.loads(body))
        return self._commit(found.group(1), body)

    def _create(self, request: dict) -> None:
        repo = "/".join(filter(None, (request.get("organization"), request["name"])))
        if repo in self.server.repos:
            return self._answer(
                409, {"error": "You already created this model repo", "url": f"{self.server.url}/{repo}"}
            )
        self.server.repos[repo] = {}
        return self._answer(200, {"url": f"{self.server.url}/{repo}", "name": repo})

    def _preupload(self, request: dict) -> None:
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in request["files"]]
        return self._answer(200, {"files": files})

    def _commit(self, repo: str, body: bytes) -> None:
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "file":
                self.server.repos[repo][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            elif item["key"] != "header":
                return self._answer(400, {"error": f"the stand-in takes inline files only, not {item['key']}"})
        return self._answer(200, {"commitUrl": f"{self.server.url}/{repo}/commit/{'0' * 40}", "commitOid": "0" * 40})

    def _answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # quiet: pytest shows the test's own output
        pass
