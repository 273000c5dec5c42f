"""A local stand-in for the Hugging Face Hub's HTTP API, serving model folders as repositories.

It answers what ``huggingface_hub.snapshot_download`` asks (repo info per revision, the recursive
file tree, HEAD/GET of ``resolve`` URLs with the commit and ETag headers), so tests fill a real Hub
cache through huggingface_hub's own download code, with no network.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    """Serve ``repos[repo_id][revision] = folder`` at ``self.url`` (start with ``with FakeHub(...) as hub``).

    Each revision's commit hash is the SHA-1 of ``repo_id@revision``; ``requests`` counts the
    requests answered.
    """

    def __init__(self, repos: dict[str, dict[str, Path]]):
        self.repos = repos
        self.requests = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @staticmethod
    def commit(repo_id: str, revision: str) -> str:
        """The commit hash the hub reports for ``revision`` of ``repo_id``."""
        return hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()

    def _find(self, repo_id: str, rev: str) -> tuple[str, Path] | None:
        for revision, folder in self.repos.get(repo_id, {}).items():
            if rev in (revision, self.commit(repo_id, revision)):
                return self.commit(repo_id, revision), folder
        return None

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head: bool):
                hub.requests += 1
                parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
                api = parts[:2] == ["api", "models"]
                repo_id = "/".join(parts[2:4] if api else parts[:2])
                kind, rev, rest = (parts[4], parts[5], parts[6:]) if api else (parts[2], parts[3], parts[4:])
                if repo_id not in hub.repos:
                    return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
                found = hub._find(repo_id, rev)
                if found is None:
                    return self._send(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
                commit, folder = found
                files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
                if api and kind == "revision":
                    body = {
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": commit,
                        "private": False,
                        "siblings": [{"rfilename": f} for f in files],
                    }
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
                if api and kind == "tree":
                    body = [
                        {
                            "type": "file",
                            "path": f,
                            "size": (folder / f).stat().st_size,
                            "oid": hashlib.sha1((folder / f).read_bytes()).hexdigest(),
                        }
                        for f in files
                    ]
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
                path = "/".join(rest)
                if kind != "resolve" or path not in files:
                    return self._send(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"})
                data = (folder / path).read_bytes()
                headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
                return self._send(200, data, headers, head=head)

            def do_GET(self):
                self._route(head=False)

            def do_HEAD(self):
                self._route(head=True)

        return Handler

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop answering (idempotent): the Hub becomes unreachable."""
        if self.server.socket.fileno() != -1:
            self.server.shutdown()
            self.server.server_close()

    def __exit__(self, *exc) -> None:
        self.stop()
