#!/usr/bin/env python3
"""troupe and Python's huggingface_hub share one HF cache (part of the test command).

A hub stand-in on loopback (the model-info route and ranged/HEAD file routes the two
clients call) serves two tiny checkpoints from tests/goldens. troupe fetches the first by
hub id and huggingface_hub's own cache lookup finds every file it fetched; huggingface_hub
downloads the second and troupe runs it with HF_HUB_OFFLINE=1 from that cache alone,
giving the same tokens as from the checkpoint's directory.

Usage: python3 scripts/test_hub_cache.py target/release/troupe
"""

import hashlib
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import huggingface_hub

REPO = Path(__file__).resolve().parent.parent
COMMIT = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"
FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "model.safetensors"]
REPOS = {"troupe-test/by-troupe": "tiny-qwen3", "troupe-test/by-python": "tiny-llama"}


def file_of(repo_id, name):
    if repo_id not in REPOS or name not in FILES + ["README.md"]:
        return None
    if name == "README.md":
        return b"# stand-in"
    return (REPO / "tests/goldens" / REPOS[repo_id] / name).read_bytes()


class Hub(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    requests = []

    def log_message(self, *args):
        pass

    def reply(self, status, headers, body, send_body=True):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def route(self, send_body):
        Hub.requests.append((self.command, self.path))
        path = self.path.split("?")[0]
        if path.startswith("/api/models/"):
            repo_id = path[len("/api/models/"):].split("/revision/")[0]
            if repo_id not in REPOS:
                return self.reply(404, {"X-Error-Code": "RepoNotFound"}, b"{}", send_body)
            info = {"id": repo_id, "modelId": repo_id, "sha": COMMIT, "private": False,
                    "siblings": [{"rfilename": f} for f in FILES + ["README.md"]]}
            return self.reply(200, {"Content-Type": "application/json"}, json.dumps(info).encode(), send_body)
        repo_id, _, rest = path.lstrip("/").partition("/resolve/")
        name = rest.partition("/")[2]
        body = file_of(repo_id, name)
        if body is None:
            return self.reply(404, {"X-Error-Code": "EntryNotFound"}, b"{}", send_body)
        lfs = name.endswith(".safetensors")
        etag = hashlib.sha256(body).hexdigest() if lfs else hashlib.sha1(body).hexdigest()
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'}
        if lfs:
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(len(body))
        total, rng = len(body), self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start, end = int(a or 0), min(int(b) if b else total - 1, total - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{total}"
            return self.reply(206, headers, body[start:end + 1], send_body)
        self.reply(200, headers, body, send_body)

    def do_GET(self):
        self.route(True)

    def do_HEAD(self):
        self.route(False)


class Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # A client closing its kept-alive connection is not a failure; anything else is.
        if not isinstance(sys.exc_info()[1], ConnectionResetError):
            super().handle_error(request, client_address)


def troupe(binary, model, env):
    cmd = [binary, "generate", "--model", model, "--prompt-ids", "5,17,42,7", "--max-tokens", "8",
           "--ignore-eos", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)}: {r.stderr[-2000:]}"
    return json.loads(r.stdout.splitlines()[0])["token_ids"]


def main():
    binary = sys.argv[1]
    server = Server(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, HF_HOME=home, HF_ENDPOINT=endpoint)
        env.pop("HF_HUB_OFFLINE", None)
        cache = os.path.join(home, "hub")

        troupe(binary, "troupe-test/by-troupe", env)
        for name in FILES:
            found = huggingface_hub.try_to_load_from_cache("troupe-test/by-troupe", name, cache_dir=cache)
            assert isinstance(found, str), f"huggingface_hub does not see troupe's {name}: {found}"
            assert Path(found).read_bytes() == file_of("troupe-test/by-troupe", name), name
        assert huggingface_hub.try_to_load_from_cache("troupe-test/by-troupe", "README.md", cache_dir=cache) is None

        os.environ.update(HF_HOME=home, HF_ENDPOINT=endpoint)
        for name in FILES:
            path = huggingface_hub.hf_hub_download("troupe-test/by-python", name, cache_dir=cache,
                                                   endpoint=endpoint)
        snapshot = Path(path).parent
        seen = len(Hub.requests)
        offline = troupe(binary, "troupe-test/by-python", dict(env, HF_HUB_OFFLINE="1"))
        assert len(Hub.requests) == seen, "troupe reached the hub while offline"
        local = troupe(binary, str(REPO / "tests/goldens/tiny-llama"), env)
        assert offline == local, (offline, local)
        print(f"hub cache shared both ways: troupe's fetch seen by huggingface_hub "
              f"{huggingface_hub.__version__}, its snapshot {snapshot.name[:8]} run offline by troupe")
    server.shutdown()


if __name__ == "__main__":
    main()
