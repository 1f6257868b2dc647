"""A small Hugging Face Hub for the tests: stdlib ``http.server`` on 127.0.0.1, real HTTP, real ``huggingface_hub``.

It implements what ``huggingface_hub`` (>= 1.31, tried with 2.4) calls for repositories, LFS uploads,
commits, paths-info and downloads, with the Hub's semantics where coldsnap depends on them:

* ``POST /api/repos/create`` (409 with ``url`` when the repository exists, as ``exist_ok`` needs);
* ``POST /api/{type}s/{repo}/preupload/{rev}``: every file is ``lfs``;
* ``POST /{prefix}{repo}.git/info/lfs/objects/batch``: ``transfer: basic``; an object already stored
  gets no ``actions`` (the client then uploads nothing); otherwise an upload href and a verify href;
* ``PUT /lfs-upload/{oid}``: the server hashes the body and refuses (400) bytes whose SHA-256 is not
  the oid; ``POST /lfs-verify/{oid}``;
* ``POST /api/{type}s/{repo}/commit/{rev}`` (NDJSON ``header``, ``file``, ``lfsFile``, ``deletedFile``):
  a new commit (40 hex), refusing an ``lfsFile`` whose object was never uploaded;
* ``POST /api/{type}s/{repo}/paths-info/{rev}`` (``lfs.oid`` is the SHA-256), ``GET .../tree/{rev}``,
  ``GET .../revision/{rev}``;
* ``HEAD``/``GET /{prefix}{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag`` (the LFS
  SHA-256), ``X-Linked-Etag``, ``X-Linked-Size`` and ``Range``.

Errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``), which
``huggingface_hub.utils.hf_raise_for_status`` maps to its typed errors. No Xet: the client must run
with ``HF_HUB_DISABLE_XET=1`` (with ``hf_xet`` importable it asks for ``/xet-write-token`` and gets 404).

Test hooks: :meth:`LocalHub.tamper` replaces the bytes served for a path while the tree keeps its
LFS metadata (a corrupt or truncated object on the server); :attr:`LocalHub.lfs_uploads` counts the
bytes-carrying PUTs (:attr:`LocalHub.lfs_uploaded_oids` names their oids); :attr:`LocalHub.commits` counts commits. LFS objects live in files under
``root`` (``lfs/<oid>``), so large packs do not sit in memory.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote

_TYPES = {"models": "model", "datasets": "dataset"}
_PREFIX = {"model": "", "dataset": "datasets/"}


@dataclass
class Entry:
    size: int
    sha256: str  # LFS oid (also for small files: the tests only store LFS files and a README)
    blob: Path | None = None  # file holding the bytes served (None: an inline file, ``data``)
    data: bytes = b""


@dataclass
class Repo:
    private: bool
    commits: list[tuple[str, dict[str, Entry]]] = field(default_factory=list)  # (sha, tree), oldest first
    branches: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> tuple[str, dict[str, Entry]] | None:
        sha = self.branches.get(unquote(revision), unquote(revision))
        return next(((s, t) for s, t in self.commits if s == sha), None)


class LocalHub:
    """The server's state and its thread. Use as a context manager; :attr:`url` is the endpoint."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        (self.root / "lfs").mkdir(parents=True, exist_ok=True)
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lock = threading.Lock()
        self.lfs_uploads = 0
        self.lfs_uploaded_oids: list[str] = []  # the oid of each bytes-carrying PUT, in order
        self.commits = 0
        self.created: list[tuple[str, str, bool]] = []  # (type, repo_id, private)
        self.refuse_commits: int | None = None  # an HTTP status every commit gets (403: a read-only token)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> LocalHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def create(self, repo_id: str, repo_type: str = "model", private: bool = True) -> None:
        with self.lock:
            if (repo_type, repo_id) not in self.repos:
                repo = Repo(private)
                sha = secrets.token_hex(20)
                repo.commits.append((sha, {}))
                repo.branches["main"] = sha
                self.repos[(repo_type, repo_id)] = repo
                self.created.append((repo_type, repo_id, private))

    def tamper(self, repo_id: str, path: str, data: bytes, repo_type: str = "model") -> None:
        """Serve ``data`` for ``path`` at the head of ``main`` from now on; the tree's size and LFS
        SHA-256 stay what they were (bit rot, a truncated or extended blob on the server)."""
        with self.lock:
            entry = self.repos[(repo_type, repo_id)].resolve("main")[1][path]
            blob = self.root / "lfs" / f"tampered-{secrets.token_hex(8)}"
            blob.write_bytes(data)
            entry.blob = blob

    def plant(self, repo_id: str, path: str, data: bytes, *, claimed_sha256: str | None = None, repo_type: str = "model") -> None:
        """Commit ``data`` at ``path`` directly, reporting ``claimed_sha256`` (default: its real SHA-256) as its LFS oid."""
        self.create(repo_id, repo_type)
        blob = self.root / "lfs" / f"planted-{secrets.token_hex(8)}"
        blob.write_bytes(data)
        entry = Entry(len(data), claimed_sha256 or hashlib.sha256(data).hexdigest(), blob)
        with self.lock:
            repo = self.repos[(repo_type, repo_id)]
            tree = dict(repo.resolve("main")[1])
            tree[path] = entry
            sha = secrets.token_hex(20)
            repo.commits.append((sha, tree))
            repo.branches["main"] = sha

    def objects(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> dict[str, Entry]:
        with self.lock:
            return dict(self.repos[(repo_type, repo_id)].resolve(revision)[1])


def _handler(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        # -- helpers ----------------------------------------------------------------------------
        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, *, head: bool = False) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, value: object, headers: dict[str, str] | None = None) -> None:
            self._send(status, json.dumps(value).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _error(self, status: int, code: str, message: str, *, head: bool = False) -> None:
            self._send(
                status, json.dumps({"error": message}).encode(), {"X-Error-Code": code, "X-Error-Message": message}, head=head
            )

        def _repo(self, repo_type: str, repo_id: str, revision: str | None, *, head: bool = False):
            with hub.lock:
                repo = hub.repos.get((repo_type, repo_id))
                if repo is None:
                    self._error(404, "RepoNotFound", f"Repository {repo_id} not found", head=head)
                    return None
                found = repo.resolve(revision or "main")
            if found is None:
                self._error(404, "RevisionNotFound", f"Revision {revision} not found", head=head)
                return None
            return repo, found[0], found[1]

        @staticmethod
        def _info(path: str, entry: Entry) -> dict[str, object]:
            return {
                "type": "file",
                "path": path,
                "size": entry.size,
                "oid": hashlib.sha1(entry.sha256.encode()).hexdigest(),
                "lfs": {"oid": entry.sha256, "size": entry.size, "pointerSize": 134},
            }

        # -- routes -----------------------------------------------------------------------------
        def do_POST(self) -> None:
            path = self.path.split("?")[0]
            if path == "/api/repos/create":
                body = json.loads(self._body())
                repo_type = body.get("type") or "model"
                repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
                exists = (repo_type, repo_id) in hub.repos
                private = body.get("visibility", "private" if body.get("private") else "public") != "public"
                hub.create(repo_id, repo_type, private)
                url = f"{hub.url}/{_PREFIX[repo_type]}{repo_id}"
                self._json(409 if exists else 200, {"url": url, "name": repo_id, **({"error": "exists"} if exists else {})})
                return
            if m := re.fullmatch(r"/(?:datasets/)?(.+)\.git/info/lfs/objects/batch", path):
                body = json.loads(self._body())
                objects = []
                for obj in body["objects"]:
                    item = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
                    if not (hub.root / "lfs" / obj["oid"]).exists():
                        item["actions"] = {
                            "upload": {"href": f"{hub.url}/lfs-upload/{obj['oid']}"},
                            "verify": {"href": f"{hub.url}/lfs-verify/{obj['oid']}"},
                        }
                    objects.append(item)
                self._json(200, {"transfer": "basic", "objects": objects})
                return
            if m := re.fullmatch(r"/lfs-verify/([0-9a-f]{64})", path):
                self._body()
                exists = (hub.root / "lfs" / m.group(1)).exists()
                self._json(200 if exists else 404, {"ok": exists})
                return
            m = re.fullmatch(r"/api/(models|datasets)/([^/]+/[^/]+)/(preupload|commit|paths-info)/(.+)", path)
            if not m:
                self._error(404, "NotFound", f"no route POST {path}")
                return
            repo_type, repo_id, action, revision = _TYPES[m.group(1)], m.group(2), m.group(3), m.group(4)
            body = self._body()
            found = self._repo(repo_type, repo_id, revision)
            if found is None:
                return
            repo, _sha, tree = found
            if action in ("preupload", "commit") and hub.refuse_commits:
                self._error(hub.refuse_commits, "Forbidden", f"You don't have the rights to write to {repo_id}")
                return
            if action == "preupload":
                files = json.loads(body)["files"]
                self._json(200, {"files": [{"path": f["path"], "uploadMode": "lfs", "shouldIgnore": False} for f in files]})
            elif action == "paths-info":
                paths = parse_qs(body.decode())["paths"]
                self._json(200, [self._info(p, tree[p]) for p in paths if p in tree])
            else:
                self._commit(repo, repo_type, repo_id, revision, tree, body)

        def _commit(self, repo: Repo, repo_type: str, repo_id: str, revision: str, tree: dict[str, Entry], body: bytes) -> None:
            new_tree = dict(tree)
            for line in body.splitlines():
                if not line.strip():
                    continue
                op = json.loads(line)
                value = op["value"]
                if op["key"] == "lfsFile":
                    blob = hub.root / "lfs" / value["oid"]
                    if not blob.exists():
                        self._error(422, "LfsObjectMissing", f"LFS object {value['oid']} was not uploaded")
                        return
                    new_tree[value["path"]] = Entry(int(value["size"]), value["oid"], blob)
                elif op["key"] == "file":
                    data = base64.b64decode(value["content"])
                    new_tree[value["path"]] = Entry(len(data), hashlib.sha256(data).hexdigest(), None, data)
                elif op["key"] in ("deletedFile", "deletedFolder"):
                    new_tree.pop(value["path"], None)
            sha = secrets.token_hex(20)
            with hub.lock:
                repo.commits.append((sha, new_tree))
                repo.branches[unquote(revision)] = sha
                hub.commits += 1
            self._json(200, {"commitUrl": f"{hub.url}/{_PREFIX[repo_type]}{repo_id}/commit/{sha}", "commitOid": sha})

        def do_PUT(self) -> None:
            m = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", self.path)
            if not m:
                self._error(404, "NotFound", f"no route PUT {self.path}")
                return
            oid = m.group(1)
            remaining = int(self.headers.get("Content-Length") or 0)
            h = hashlib.sha256()
            temp = hub.root / "lfs" / f"{oid}.{secrets.token_hex(4)}.partial"
            with open(temp, "wb") as f:
                while remaining:
                    chunk = self.rfile.read(min(remaining, 1 << 20))
                    if not chunk:
                        break
                    h.update(chunk)
                    f.write(chunk)
                    remaining -= len(chunk)
            if h.hexdigest() != oid:  # the Hub refuses bytes that do not hash to the announced oid
                temp.unlink()
                self._error(400, "BadRequest", f"uploaded bytes hash to {h.hexdigest()}, not {oid}")
                return
            os.replace(temp, hub.root / "lfs" / oid)
            with hub.lock:
                hub.lfs_uploads += 1
                hub.lfs_uploaded_oids.append(oid)
            self._send(200)

        def do_HEAD(self) -> None:
            self._resolve(head=True)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            m = re.fullmatch(r"/api/(models|datasets)/([^/]+/[^/]+)(?:/(tree|revision)/([^/]+))?(/.*)?", path)
            if m and m.group(5):  # e.g. /xet-write-token/main: this Hub offers no Xet
                self._error(404, "NotFound", f"no route GET {path}")
                return
            if m:
                repo_type, repo_id, kind, revision = _TYPES[m.group(1)], m.group(2), m.group(3), m.group(4)
                found = self._repo(repo_type, repo_id, revision)
                if found is None:
                    return
                repo, sha, tree = found
                if kind == "tree":
                    self._json(200, [self._info(p, e) for p, e in sorted(tree.items())])
                else:
                    siblings = [{"rfilename": p, "size": e.size} for p, e in sorted(tree.items())]
                    self._json(200, {"id": repo_id, "sha": sha, "private": repo.private, "siblings": siblings})
                return
            self._resolve(head=False)

        def _resolve(self, *, head: bool) -> None:
            path = self.path.split("?")[0]
            m = re.fullmatch(r"/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if not m:
                self._error(404, "NotFound", f"no route {path}", head=head)
                return
            repo_type = "dataset" if m.group(1) else "model"
            found = self._repo(repo_type, m.group(2), m.group(3), head=head)
            if found is None:
                return
            _, sha, tree = found
            entry = tree.get(unquote(m.group(4)))
            if entry is None:
                self._error(404, "EntryNotFound", f"{m.group(4)} does not exist at {m.group(3)}", head=head)
                return
            data = entry.blob.read_bytes() if entry.blob is not None else entry.data
            headers = {
                "X-Repo-Commit": sha,
                "ETag": f'"{entry.sha256}"',
                "X-Linked-Etag": f'"{entry.sha256}"',
                "X-Linked-Size": str(entry.size),
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            status = 200
            if (r := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))) and not head:
                start = int(r.group(1))
                end = int(r.group(2)) + 1 if r.group(2) else len(data)
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
                data, status = data[start:end], 206
            if head:
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return
            self._send(status, data, headers)

    return Handler


if __name__ == "__main__":  # python tests/cache/local_hub.py ROOT: serve until killed, print the URL (benchmarks)
    import sys
    import time

    with LocalHub(Path(sys.argv[1])) as running:
        print(running.url, flush=True)
        while True:
            time.sleep(3600)
