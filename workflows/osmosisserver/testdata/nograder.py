"""A rollout server without a grader: it posts the completion callback
and never a grader callback. A rollout labelled "bad" is refused (422)."""
import json, os, threading, urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def complete(req):
    body = json.dumps({"status": "success", "rollout_id": req["rollout_id"], "err_message": None, "err_category": None}).encode()
    r = urllib.request.Request(req["completion_callback_url"], data=body, method="POST",
                               headers={"Content-Type": "application/json", "Authorization": "Bearer " + req["controller_api_key"]})
    urllib.request.urlopen(r, timeout=10).read()


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(200, {"status": "ok"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if req.get("label") == "bad":
            self.reply(422, {"detail": [{"loc": ["body", "label"], "msg": "label is bad"}]})
            return
        self.reply(202, {})
        threading.Thread(target=complete, args=(req,), daemon=True).start()


ThreadingHTTPServer(("127.0.0.1", int(os.environ["_OSMOSIS_ROLLOUT_PORT"])), H).serve_forever()
