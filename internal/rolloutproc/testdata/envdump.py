"""Answers /health with what the supervisor gave it; prints a secret."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

KEYS = ["VIRTUAL_ENV", "ROLLOUTPROC_WITHHELD", "ROLLOUTPROC_TEST", "ROLLOUTPROC_SECRET", "PYTHONUNBUFFERED",
        "_OSMOSIS_ROLLOUT_PORT", "_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", "_OSMOSIS_ROLLOUT_INSTANCE_ID"]


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        body = {k: os.environ.get(k) for k in KEYS}
        body["cwd"] = os.getcwd()
        body["artifact_root_exists"] = os.path.isdir(os.environ.get("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", ""))
        if os.environ.get("ROLLOUTPROC_WRONG_INSTANCE"):
            body["instance_id"] = "someone-else"
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


print("the secret is", os.environ.get("ROLLOUTPROC_SECRET"))
print("partial line without newline", end="")
sys.stdout.write("\nready\n")
HTTPServer(("127.0.0.1", int(os.environ["_OSMOSIS_ROLLOUT_PORT"])), H).serve_forever()
