"""A local stand-in for the Hugging Face Hub HTTP API, for tests of code that uses the real huggingface_hub client.

It serves, on 127.0.0.1, the routes that `HfApi.create_repo`, `create_branch`, `upload_folder`, `repo_info`
and `whoami` call (routes and payloads as in huggingface_hub's hf_api.py and _commit_api.py), and those that
`snapshot_download` / `hf_hub_download` read (_snapshot_download.py, file_download.py):

    POST /api/repos/create                        {"name", "organization", "visibility"?, "type"?}
    GET  /api/{type}s/{owner}/{name}[/revision/{rev}]
    POST /api/{type}s/{owner}/{name}/branch/{branch}   {"startingPoint"?}
    POST /api/validate-yaml                       {"content", "repoType"}
    POST /api/{type}s/{owner}/{name}/preupload/{rev}   {"files": [{"path", "sample", "size"}], "gitIgnore"?}
    POST /api/{type}s/{owner}/{name}/commit/{rev}      NDJSON: a header line, then one line per file operation
    GET  /api/whoami-v2
    GET  /api/{type}s/{owner}/{name}/tree/{rev}        the files at rev: [{"type": "file", "path", "size", "oid"}]
    HEAD /{owner}/{name}/resolve/{rev}/{path}          a model file's metadata: X-Repo-Commit, ETag, Content-Length
    GET  /{owner}/{name}/resolve/{rev}/{path}          its bytes

A revision is a branch or a commit sha that `repo_info` gave out (the sha of a branch's content: the same files,
the same sha). Errors carry the Hub's `X-Error-Code` header (RepoNotFound, RevisionNotFound, EntryNotFound), from
which the client raises its typed errors. Files are served as regular git files (no LFS or Xet storage).

`preupload` answers "regular" for every file, so the client sends every file's bytes base64-encoded inside the
NDJSON commit and the server sees exactly what was uploaded. The real Hub answers "lfs" for large and binary
files (then the client uploads them through Xet or LFS storage, which this fake does not implement).

Every request is recorded (`hub.requests`), every commit too (`hub.commits`, with the bytes of each file), and
the resulting repository state is in `hub.repos[repo_id][branch][path]`; `hub.add_repo` fills a repository for
download tests. `hub.fail_with(status, route)` makes a route (or every route) answer an error, to test error handling.
"""

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import yaml

ROUTES = ("create_repo", "repo_info", "create_branch", "validate_yaml", "preupload", "commit", "whoami", "repo_tree",
          "resolve")
_REPO_ROUTE = re.compile(r"^/api/(?P<type>models|datasets|spaces)/(?P<owner>[^/]+)/(?P<name>[^/]+)(?P<rest>/.*)?$")
_RESOLVE_ROUTE = re.compile(r"^/(?P<owner>[^/]+)/(?P<name>[^/]+)/resolve/(?P<revision>[^/]+)/(?P<path>.+)$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
INITIAL_GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


@dataclass
class Request:
    method: str
    path: str  # unquoted, without the query string
    query: dict[str, str]
    body: Any  # parsed JSON, a list of parsed NDJSON lines for commits, or None
    authorization: str | None


@dataclass
class Commit:
    repo_id: str
    revision: str
    summary: str
    description: str
    oid: str
    files: dict[str, bytes] = field(default_factory=dict)  # path -> bytes added or replaced by this commit
    deleted: list[str] = field(default_factory=list)


def git_blob_oid(data: bytes) -> str:
    """The git object id of a file's content (what the Hub returns as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _HttpError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None, **extra):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code  # the X-Error-Code header, as the Hub sends it
        self.extra = extra  # more fields of the error body


@dataclass
class _Response:
    status: int
    body: dict | list | bytes  # JSON, or a file's bytes
    headers: dict[str, str] = field(default_factory=dict)


class FakeHub:
    """Hub API server on 127.0.0.1 (a free port); use as a context manager or call start()/stop()."""

    def __init__(self, user: str = "test-user"):
        self.user = user
        self.requests: list[Request] = []
        self.commits: list[Commit] = []
        self.repos: dict[str, dict[str, dict[str, bytes]]] = {}  # repo_id -> branch -> path -> bytes
        self.private: dict[str, bool] = {}
        self.unhandled: list[Request] = []
        self._failures: dict[str, tuple[int, str]] = {}
        self._snapshots: dict[tuple[str, str], dict[str, bytes]] = {}  # (repo_id, sha) -> the files repo_info named
        self._commit_count = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeHub.endpoint was read before start(); call start() or use `with FakeHub() as hub`.")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            fake_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def fail_with(self, status: int, route: str = "*", message: str = "Simulated failure") -> None:
        """Make `route` (one of ROUTES, or "*" for all) answer `status` with `{"error": message}`."""
        if route != "*" and route not in ROUTES:
            raise ValueError(f"fail_with got route {route!r}; expected '*' or one of {ROUTES}.")
        self._failures[route] = (status, message)

    def requests_to(self, route: str) -> list[Request]:
        return [request for request in self.requests if _route_name(request.method, request.path) == route]

    def add_repo(self, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Put `files` (path -> bytes) on `branch` of `repo_id` (created with a main branch if new), as a download
        test needs a repository; returns the branch's commit sha."""
        with self._lock:
            self.repos.setdefault(repo_id, {"main": {".gitattributes": INITIAL_GITATTRIBUTES}})
            self.private.setdefault(repo_id, False)
            self.repos[repo_id][branch] = {".gitattributes": INITIAL_GITATTRIBUTES, **files}
            return self._revision(repo_id, branch)[0]

    # ---------------------------------------------------------------- request handling (called under the lock)

    def handle(self, method: str, raw_path: str, headers, raw_body: bytes) -> _Response:
        url = urlsplit(raw_path)
        path = unquote(url.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        body = _parse_body(raw_body, headers.get("Content-Type", ""))
        request = Request(method, path, query, body, headers.get("Authorization"))
        with self._lock:
            self.requests.append(request)
            route = _route_name(method, url.path)  # before unquoting: a branch may hold an encoded '/'
            if route is None:
                self.unhandled.append(request)
                return _Response(404, {"error": f"fake hub has no route for {method} {path}"})
            failure = self._failures.get(route) or self._failures.get("*")
            if failure is not None:
                return _Response(failure[0], {"error": failure[1]})
            try:
                answer = getattr(self, f"_{route}")(url.path, query, body, request)
            except _HttpError as e:
                error_headers = {"X-Error-Code": e.error_code} if e.error_code else {}
                return _Response(e.status, {"error": e.message, **e.extra}, error_headers)
            return answer if isinstance(answer, _Response) else _Response(200, answer)

    def _repo_and_rest(self, raw_path: str) -> tuple[str, list[str]]:
        match = _REPO_ROUTE.match(raw_path)
        repo_id = f"{unquote(match['owner'])}/{unquote(match['name'])}"
        self._check_repo(repo_id, raw_path)
        rest = [unquote(part) for part in (match["rest"] or "").split("/") if part]
        return repo_id, rest

    def _check_repo(self, repo_id: str, raw_path: str) -> None:
        if repo_id not in self.repos:
            raise _HttpError(404, f"Repository Not Found for url: {raw_path}", error_code="RepoNotFound")

    def _branch(self, repo_id: str, revision: str) -> dict[str, bytes]:
        if revision not in self.repos[repo_id]:
            raise _HttpError(404, f"Invalid rev id: {revision}", error_code="RevisionNotFound")
        return self.repos[repo_id][revision]

    def _revision(self, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]]:
        """(commit sha, files) of a branch, or of a sha given out before; the branch's files are kept under its sha,
        so a sha keeps naming the same files after the branch moves on."""
        if (repo_id, revision) in self._snapshots:
            return revision, self._snapshots[repo_id, revision]
        files = self._branch(repo_id, revision)
        sha = git_blob_oid(json.dumps(sorted((p, git_blob_oid(d)) for p, d in files.items())).encode())
        self._snapshots.setdefault((repo_id, sha), dict(files))
        return sha, files

    def _create_repo(self, raw_path, query, body, request) -> dict:
        repo_id = f"{body.get('organization') or self.user}/{body['name']}"
        if repo_id in self.repos:
            # The client reads "url" from this 409 body when called with exist_ok=True.
            raise _HttpError(409, "You already created this model repo", url=f"{self.endpoint}/{repo_id}")
        # Like the Hub: a new repo has a main branch whose first commit adds .gitattributes.
        self.repos[repo_id] = {"main": {".gitattributes": INITIAL_GITATTRIBUTES}}
        self.private[repo_id] = body.get("visibility") == "private"
        return {"url": f"{self.endpoint}/{repo_id}", "name": repo_id, "id": repo_id}

    def _repo_info(self, raw_path, query, body, request) -> dict:
        repo_id, rest = self._repo_and_rest(raw_path)
        revision = rest[1] if len(rest) >= 2 else "main"
        sha, files = self._revision(repo_id, revision)
        return {
            "id": repo_id,
            "sha": sha,
            "private": self.private[repo_id],
            "siblings": [{"rfilename": path} for path in sorted(files)],
        }

    def _repo_tree(self, raw_path, query, body, request) -> list:
        repo_id, rest = self._repo_and_rest(raw_path)
        _, files = self._revision(repo_id, rest[1])
        under = "/".join(rest[2:])
        return [
            {"type": "file", "path": path, "size": len(data), "oid": git_blob_oid(data)}
            for path, data in sorted(files.items())
            if not under or path.startswith(under.rstrip("/") + "/")
        ]

    def _resolve(self, raw_path, query, body, request) -> _Response:
        match = _RESOLVE_ROUTE.match(raw_path)
        repo_id = f"{unquote(match['owner'])}/{unquote(match['name'])}"
        self._check_repo(repo_id, raw_path)
        sha, files = self._revision(repo_id, unquote(match["revision"]))
        path = unquote(match["path"])
        if path not in files:
            raise _HttpError(404, f"Entry not found: {path}", error_code="EntryNotFound")
        data = files[path]
        headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_oid(data)}"', "Content-Length": str(len(data))}
        return _Response(200, b"" if request.method == "HEAD" else data, headers)

    def _create_branch(self, raw_path, query, body, request) -> dict:
        repo_id, rest = self._repo_and_rest(raw_path)
        branch = rest[1]
        if branch in self.repos[repo_id]:
            raise _HttpError(409, "Reference already exists")
        starting_point = (body or {}).get("startingPoint", "main")
        self.repos[repo_id][branch] = dict(self._branch(repo_id, starting_point))
        return {}

    def _validate_yaml(self, raw_path, query, body, request) -> dict:
        content = body["content"]
        match = re.match(r"^---\n(.*?)\n---\n", content, flags=re.DOTALL)
        if match is None:
            return {"warnings": [{"message": "empty or missing yaml metadata in repo card"}]}
        try:
            metadata = yaml.safe_load(match[1]) or {}
        except yaml.YAMLError as e:
            raise _HttpError(400, f"Invalid YAML: {e}") from e
        # Like the Hub, refuse a base_model that is not a repo id (a local path, for example).
        base_models = metadata.get("base_model", [])
        for base_model in [base_models] if isinstance(base_models, str) else base_models:
            if not _HUB_ID.match(str(base_model)):
                raise _HttpError(400, f'"base_model" with value "{base_model}" is not valid.')
        return {"warnings": []}

    def _preupload(self, raw_path, query, body, request) -> dict:
        repo_id, rest = self._repo_and_rest(raw_path)
        files = self._branch(repo_id, rest[1])
        answers = []
        for entry in body["files"]:
            existing = files.get(entry["path"])
            answers.append(
                {
                    "path": entry["path"],
                    "uploadMode": "regular",
                    "shouldIgnore": False,
                    "oid": None if existing is None else git_blob_oid(existing),
                }
            )
        return {"files": answers}

    def _commit(self, raw_path, query, body, request) -> dict:
        repo_id, rest = self._repo_and_rest(raw_path)
        revision = rest[1]
        if query.get("create_pr"):
            raise _HttpError(400, "fake hub does not implement pull requests")
        files = self._branch(repo_id, revision)
        header = body[0]
        if header.get("key") != "header":
            raise _HttpError(400, "the first NDJSON line of a commit must be the header")
        self._commit_count += 1
        oid = hashlib.sha1(f"{repo_id}@{revision}#{self._commit_count}".encode()).hexdigest()
        commit = Commit(repo_id, revision, header["value"]["summary"], header["value"].get("description", ""), oid)
        for line in body[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                if value.get("encoding") != "base64":
                    raise _HttpError(400, f"unsupported encoding {value.get('encoding')!r}")
                commit.files[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                commit.deleted.append(value["path"])
            else:
                raise _HttpError(400, f"fake hub does not implement commit operation {key!r}")
        for path in commit.deleted:
            for existing in [p for p in files if p == path or p.startswith(path.rstrip("/") + "/")]:
                del files[existing]
        files.update(commit.files)
        self.commits.append(commit)
        return {"success": True, "commitOid": oid, "commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}"}

    def _whoami(self, raw_path, query, body, request) -> dict:
        if not request.authorization:
            raise _HttpError(401, "Invalid credentials in Authorization header")
        return {"type": "user", "name": self.user, "fullname": "Test User", "orgs": []}


def _route_name(method: str, path: str) -> str | None:
    if method == "POST" and path == "/api/repos/create":
        return "create_repo"
    if method == "POST" and path == "/api/validate-yaml":
        return "validate_yaml"
    if method == "GET" and path == "/api/whoami-v2":
        return "whoami"
    if method in ("GET", "HEAD") and not path.startswith("/api/") and _RESOLVE_ROUTE.match(path):
        return "resolve"
    match = _REPO_ROUTE.match(path)
    if match is None:
        return None
    rest = [part for part in (match["rest"] or "").split("/") if part]
    if method == "GET" and (not rest or (rest[0] == "revision" and len(rest) >= 2)):
        return "repo_info"
    if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
        return "repo_tree"
    if method == "POST" and len(rest) >= 2 and rest[0] in ("branch", "preupload", "commit"):
        return {"branch": "create_branch", "preupload": "preupload", "commit": "commit"}[rest[0]]
    return None


def _parse_body(raw_body: bytes, content_type: str) -> Any:
    if not raw_body:
        return None
    if "ndjson" in content_type:
        return [json.loads(line) for line in raw_body.splitlines() if line.strip()]
    return json.loads(raw_body)


class _Handler(BaseHTTPRequestHandler):
    fake_hub: FakeHub

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw_body = self.rfile.read(length) if length else b""
        response = self.fake_hub.handle(self.command, self.path, self.headers, raw_body)
        is_file = isinstance(response.body, bytes)
        data = response.body if is_file else json.dumps(response.body).encode()
        self.send_response(response.status)
        self.send_header("Content-Type", "application/octet-stream" if is_file else "application/json")
        # A HEAD answer names the size of the file a GET would send.
        size = response.headers.pop("Content-Length", None) or str(len(data))
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", size)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _serve

    def log_message(self, format, *args) -> None:  # keep test output clean; requests are in hub.requests
        pass


def allow_hub_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switch off huggingface_hub's offline mode (HF_HUB_OFFLINE, read at import) for this test only.

    The test suite runs offline so nothing reaches the real Hub; requests to the fake Hub must still go through.
    """
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def fake_hub(monkeypatch):
    """A started FakeHub, with offline mode off; point HfApi at it with `HfApi(endpoint=fake_hub.endpoint)`."""
    allow_hub_requests(monkeypatch)
    with FakeHub() as hub:
        yield hub


def serve_downloads(monkeypatch: pytest.MonkeyPatch, hub: FakeHub, cache_dir) -> None:
    """Send this process's huggingface_hub downloads to `hub`, into the HF cache `cache_dir`, for this test only
    (the client reads HF_ENDPOINT, its URL template and HF_HUB_CACHE once, at import)."""
    import huggingface_hub.constants

    allow_hub_requests(monkeypatch)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.endpoint)
    url_template = hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", url_template)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache_dir))


def download_env(hub: FakeHub, cache_dir) -> dict[str, str]:
    """The same for a child process: its environment."""
    return {"HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(cache_dir), "HF_HUB_OFFLINE": "0"}


def folder_files(folder) -> dict[str, bytes]:
    """A folder's files, relative path -> bytes (what `add_repo` takes)."""
    from pathlib import Path

    files = sorted(path for path in Path(folder).rglob("*") if path.is_file())
    return {str(path.relative_to(folder)): path.read_bytes() for path in files}
