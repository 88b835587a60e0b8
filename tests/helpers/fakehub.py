"""A small fake of the Hugging Face Hub HTTP API, for push tests without the network.

It speaks exactly the endpoints that huggingface_hub 2.x calls for `create_repo`, `create_branch`,
`create_commit` (README metadata validation, preupload, git-LFS batch + basic PUT, ndjson commit),
`repo_info` and `whoami`, read from the installed client's source (hf_api.py, _commit_api.py, lfs.py).
The real client is pointed at it through HF_ENDPOINT; Xet is turned off on the client side
(HF_HUB_DISABLE_XET) because this server does not implement the Xet CAS protocol, so "lfs" files
take the plain git-LFS path.

Failures are injected per endpoint (`hub.fail["commit"] = 1` answers the next commit with HTTP 500)
and every request is logged, so tests can assert what was (re-)uploaded. The server never stores
or logs request headers: the Authorization header is only checked to be a Bearer token.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import yaml

# what the real Hub stores in LFS by default (its .gitattributes), plus anything binary or large
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".png", ".jpg", ".model", ".gguf", ".h5", ".zip")
LFS_MIN_SIZE = 10 * 1024 * 1024

_REPO_OP = re.compile(r"^/api/models/([^/]+)/([^/]+)/(preupload|commit|branch|revision)/(.+)$")
_REPO = re.compile(r"^/api/models/([^/]+)/([^/]+)$")
_LFS_BATCH = re.compile(r"^/([^/]+)/([^/]+)\.git/info/lfs/objects/batch$")
_LFS_PUT = re.compile(r"^/lfs-upload/([0-9a-f]{64})$")
_RESOLVE = re.compile(r"^/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    private: bool
    # branch -> {path: bytes}; LFS files are stored as their content too (resolved from the LFS store)
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    heads: dict[str, str] = field(default_factory=lambda: {"main": "0" * 40})
    commits: list[dict] = field(default_factory=list)


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}  # sha256 hex -> content
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self.fail: dict[str, int] = {}  # endpoint kind -> how many more times to fail
        self.fail_status = 500
        self.authorized: list[bool] = []  # one per write request: carried a Bearer hf_ token
        self.gated: set[str] = set()  # repos whose files answer 403 GatedRepo without a token
        # what /api/whoami-v2 answers for any hf_ token (tests change the role or the orgs)
        self.whoami: dict = {
            "type": "user",
            "name": "tester",
            "orgs": [{"name": "acme", "roleInOrg": "write"}],
            "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": "write"}},
        }
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.url = ""

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    # -- helpers for tests -----------------------------------------------------------------
    def add_model(self, repo_id: str, files: dict[str, bytes], *, gated: bool = False) -> str:
        """A public model repo holding `files` on main (for downloads); returns its commit sha."""
        sha = hashlib.sha1(
            json.dumps(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items())).encode()
        ).hexdigest()
        self.repos[repo_id] = Repo(private=False, branches={"main": dict(files)}, heads={"main": sha})
        if gated:
            self.gated.add(repo_id)
        return sha

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        return dict(self.repos[repo_id].branches[branch])

    def count(self, method: str, prefix: str, status: int | None = None) -> int:
        return sum(
            1 for m, p, s in self.requests if m == method and p.startswith(prefix) and (status is None or s == status)
        )

    def _should_fail(self, kind: str) -> bool:
        with self.lock:
            left = self.fail.get(kind, 0)
            if left > 0:
                self.fail[kind] = left - 1
                return True
            return False


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # keep test output clean (and header-free)
        pass

    # -- plumbing --------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, payload=None, *, error_code: str | None = None) -> None:
        data = json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        if error_code:  # the real Hub names the error kind in this header; the client maps it
            self.send_header("X-Error-Code", error_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        with self.fake.lock:
            self.fake.requests.append((self.command, self.path.split("?")[0], status))

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": message})

    def _authorized(self) -> bool:
        ok = (self.headers.get("Authorization") or "").startswith("Bearer hf_")
        self.fake.authorized.append(ok)
        return ok

    # -- routing ---------------------------------------------------------------------------
    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/api/whoami-v2":
            if not self._authorized():
                return self._error(401, "Invalid credentials in Authorization header")
            return self._send(200, self.fake.whoami)
        if _RESOLVE.match(path):
            return self._resolve(head=False)
        m = _REPO_OP.match(path)
        if m and m.group(3) == "revision":
            return self._repo_info(f"{m.group(1)}/{m.group(2)}", unquote(m.group(4)))
        m = _REPO.match(path)
        if m:
            return self._repo_info(f"{m.group(1)}/{m.group(2)}", "main")
        return self._error(404, f"no route for GET {path}")

    def do_HEAD(self):
        return self._resolve(head=True)

    def _resolve(self, *, head: bool):
        """GET/HEAD /{org}/{name}/resolve/{revision}/{path}: a file download, with the headers
        hf_hub_download reads (X-Repo-Commit, ETag, Content-Length) and the Hub's X-Error-Code on errors."""
        m = _RESOLVE.match(self.path.split("?")[0])
        if not m:
            return self._coded(404, "EntryNotFound", head)
        repo_id, rev, path = f"{m.group(1)}/{m.group(2)}", unquote(m.group(3)), unquote(m.group(4))
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            return self._coded(404, "RepoNotFound", head)
        if repo_id in self.fake.gated and not (self.headers.get("Authorization") or "").startswith("Bearer hf_"):
            return self._coded(403, "GatedRepo", head)
        if rev not in repo.branches:
            return self._coded(404, "RevisionNotFound", head)
        data = repo.branches[rev].get(path)
        if data is None:
            return self._coded(404, "EntryNotFound", head)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{git_blob_sha1(data)}"')
        self.send_header("X-Repo-Commit", repo.heads[rev])
        self.end_headers()
        if not head:
            self.wfile.write(data)
        with self.fake.lock:
            self.fake.requests.append((self.command, self.path.split("?")[0], 200))

    def _coded(self, status: int, code: str, head: bool) -> None:
        body = b"" if head else json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        with self.fake.lock:
            self.fake.requests.append((self.command, self.path.split("?")[0], status))

    def do_PUT(self):
        path = self.path.split("?")[0]
        m = _LFS_PUT.match(path)
        body = self._body()
        if not m:
            return self._error(404, f"no route for PUT {path}")
        if self.fake._should_fail("lfs_put"):
            return self._error(self.fake.fail_status, "storage backend unavailable")
        oid = m.group(1)
        if hashlib.sha256(body).hexdigest() != oid:
            return self._error(400, "sha256 mismatch")
        self.fake.lfs[oid] = body
        return self._send(200, {})

    def do_POST(self):
        path = self.path.split("?")[0]
        body = self._body()
        if path == "/api/repos/create":
            return self._create_repo(json.loads(body))
        if path == "/api/validate-yaml":
            return self._validate_yaml(json.loads(body))
        m = _LFS_BATCH.match(path)
        if m:
            return self._lfs_batch(f"{m.group(1)}/{m.group(2)}", json.loads(body))
        m = _REPO_OP.match(path)
        if m:
            repo_id, op, rev = f"{m.group(1)}/{m.group(2)}", m.group(3), unquote(m.group(4))
            if op == "preupload":
                return self._preupload(repo_id, rev, json.loads(body))
            if op == "commit":
                return self._commit(repo_id, rev, body)
            if op == "branch":
                return self._create_branch(repo_id, rev, json.loads(body or b"{}"))
        return self._error(404, f"no route for POST {path}")

    # -- endpoints -------------------------------------------------------------------------
    def _repo(self, repo_id: str, rev: str) -> Repo | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._send(404, {"error": "Repository not found"}, error_code="RepoNotFound")
            return None
        if rev not in repo.branches:
            self._error(404, f"Revision Not Found: {rev}")
            return None
        return repo

    def _create_repo(self, payload: dict) -> None:
        if not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        repo_id = f"{payload['organization']}/{payload['name']}"
        if repo_id in self.fake.repos:
            return self._send(
                409, {"error": "You already created this model repo", "url": f"{self.fake.url}/{repo_id}"}
            )
        self.fake.repos[repo_id] = Repo(private=payload.get("visibility") == "private")
        return self._send(200, {"url": f"{self.fake.url}/{repo_id}", "name": repo_id})

    def _create_branch(self, repo_id: str, branch: str, payload: dict) -> None:
        if not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        repo = self._repo(repo_id, "main")
        if repo is None:
            return None
        if branch in repo.branches:
            return self._error(409, "Reference already exists")
        start = payload.get("startingPoint") or "main"
        repo.branches[branch] = dict(repo.branches[start])
        repo.heads[branch] = repo.heads[start]
        return self._send(200, {})

    def _validate_yaml(self, payload: dict) -> None:
        text = payload.get("content", "")
        m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
        if not m:
            return self._send(200, {"errors": [], "warnings": [{"message": "empty or missing metadata"}]})
        try:
            meta = yaml.safe_load(m.group(1))
        except yaml.YAMLError as exc:
            return self._send(400, {"errors": [{"message": f"invalid YAML: {exc}"}]})
        if not isinstance(meta, dict):
            return self._send(400, {"errors": [{"message": "metadata must be a mapping"}]})
        return self._send(200, {"errors": [], "warnings": []})

    def _preupload(self, repo_id: str, rev: str, payload: dict) -> None:
        if not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        repo = self._repo(repo_id, rev)
        if repo is None:
            return None
        stored = repo.branches[rev]
        out = []
        for f in payload["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_SIZE or b"\0" in sample
            oid = None
            if f["path"] in stored:
                data = stored[f["path"]]
                oid = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
            out.append(
                {"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid}
            )
        return self._send(200, {"files": out})

    def _lfs_batch(self, repo_id: str, payload: dict) -> None:
        if not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        if repo_id not in self.fake.repos:
            return self._error(404, "Repository not found")
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.fake.lfs:  # already stored: no actions, the client skips it
                entry["actions"] = {"upload": {"href": f"{self.fake.url}/lfs-upload/{obj['oid']}"}}
            objects.append(entry)
        return self._send(200, {"transfer": "basic", "objects": objects})

    def _commit(self, repo_id: str, rev: str, body: bytes) -> None:
        if not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        repo = self._repo(repo_id, rev)
        if repo is None:
            return None
        if self.fake._should_fail("commit"):
            return self._error(self.fake.fail_status, "Internal Error - We're working hard to fix this")
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = lines[0]["value"]
        new_files = dict(repo.branches[rev])
        for item in lines[1:]:
            value = item["value"]
            if item["key"] == "file":
                new_files[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "lfsFile":
                if value["oid"] not in self.fake.lfs:
                    return self._error(422, f"LFS object {value['oid']} for {value['path']} not uploaded")
                new_files[value["path"]] = self.fake.lfs[value["oid"]]
            elif item["key"] == "deletedFile":
                new_files.pop(value["path"], None)
            else:
                return self._error(400, f"unsupported commit operation {item['key']}")
        oid = hashlib.sha1(json.dumps([repo.heads[rev], sorted(new_files), header["summary"]]).encode()).hexdigest()
        repo.branches[rev] = new_files
        repo.heads[rev] = oid
        repo.commits.append({"oid": oid, "branch": rev, "summary": header["summary"], "paths": sorted(new_files)})
        return self._send(
            200, {"commitUrl": f"{self.fake.url}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
        )

    def _repo_info(self, repo_id: str, rev: str) -> None:
        repo = self._repo(repo_id, rev)
        if repo is None:
            return None
        return self._send(
            200,
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": repo.heads[rev],
                "private": repo.private,
                "siblings": [{"rfilename": p} for p in sorted(repo.branches[rev])],
            },
        )
