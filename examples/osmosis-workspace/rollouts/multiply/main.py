"""multiply: a stand-in Osmosis rollout server, standard library only.

It speaks the rollout server's side of the Osmosis wire protocol (SDK v0.2
"G2" and v0.3) the way a rollout built with `create_rollout_server(...)`
does, so that osmo can host it and test against it where the SDK itself
cannot be installed. Its agent multiplies: it offers the policy a
`multiply` and an `add` tool, runs the calls the policy makes, and its
grader gives 1.0 when the last assistant text contains the row's label.

Run it as the SDK runs a rollout entrypoint (`osmosis eval run`, `osmo
serve --osmosis-rollout`), or by hand:

    python3 main.py          # listens on 127.0.0.1:$_OSMOSIS_ROLLOUT_PORT (8000)

Endpoints: GET /health, POST /rollout (202 {}; 422 naming the bad field;
429 with Retry-After when at capacity), POST /rollout/cancel ({ids} |
{prefix} | {all: true}), GET /rollout/{id}/status.

Environment it reads:
  _OSMOSIS_ROLLOUT_PORT          port (default 8000)
  _OSMOSIS_ROLLOUT_INSTANCE_ID   echoed by /health (header
                                 x-osmosis-rollout-instance-id and body
                                 "instance_id") so the supervisor knows the
                                 server is the one it started
  _OSMOSIS_ROLLOUT_ARTIFACT_ROOT where a rollout may write files (unused)
  MULTIPLY_SECRET                required: a rollout fails (agent_error)
                                 without it; its value is never printed
  MULTIPLY_GREETING              copied into each sample's extra_fields, to
                                 show that [env] reached the process
  MULTIPLY_MAX_CONCURRENT        rollouts run at once (default 32)
Test-only knobs (leave unset in real use):
  MULTIPLY_CRASH_AFTER=N         os._exit(3) just after the N-th rollout
                                 was accepted, while it is in flight
  MULTIPLY_TURN_DELAY_SEC=S      sleep S seconds before each LLM call
  MULTIPLY_ECHO_SECRET=1         leak MULTIPLY_SECRET on purpose: print it and
                                 put it in each sample's conversation (a
                                 host must redact it from what it writes)
  MULTIPLY_RETRY_AFTER_SEC=S     Retry-After of a 429 (default 5, the SDK's)
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "openai/osmosis-rollout"
SAMPLE_ID = "multiply-agent"
MAX_TURNS = 8
INSTANCE_HEADER = "x-osmosis-rollout-instance-id"
TERMINAL = ("success", "failure", "cancelled")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{verb} two integers a and b.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    for name, verb in (("multiply", "Multiply"), ("add", "Add"))
]


_LOG_LOCK = threading.Lock()


def log(msg: str) -> None:
    # One write per line: print() from several threads can interleave.
    with _LOG_LOCK:
        sys.stdout.write(f"[multiply pid={os.getpid()}] {msg}\n")
        sys.stdout.flush()


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class RolloutError(Exception):
    def __init__(self, category: str, message: str):
        super().__init__(message)
        self.category = category


class Rollout:
    def __init__(self, req: dict):
        self.req = req
        self.id = req["rollout_id"]
        self.status = "running"
        self.reward = None
        self.err_message = None
        self.cancel = threading.Event()
        timeout = req.get("agent_timeout_sec")
        self.deadline = time.monotonic() + timeout if timeout else None


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rollouts: dict[str, Rollout] = {}
        self.max_concurrent = max(1, int(env_float("MULTIPLY_MAX_CONCURRENT", 32)))
        self.running = 0
        self.accepted = 0
        self.crash_after = int(env_float("MULTIPLY_CRASH_AFTER", 0))
        self.turn_delay = env_float("MULTIPLY_TURN_DELAY_SEC", 0)
        self.retry_after = max(1, int(env_float("MULTIPLY_RETRY_AFTER_SEC", 5)))
        self.stopping = threading.Event()


STATE = State()


# ---------------------------------------------------------------- validation

SAFE_ID = re.compile(r"^[^/\\\x00]{1,256}$")


def validate(body) -> tuple[dict | None, str | None, str | None]:
    """Returns (request, None, None) or (None, field, message)."""
    if not isinstance(body, dict):
        return None, "body", "must be a JSON object"
    rid = body.get("rollout_id")
    if rid is None:
        rid = "rollout-" + uuid.uuid4().hex
    if not isinstance(rid, str) or not SAFE_ID.match(rid) or rid.strip() in ("", ".", ".."):
        return None, "rollout_id", "must be one safe path segment"
    msgs = body.get("initial_messages")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        return None, "initial_messages", "must be a list of message objects"
    for field in ("chat_completions_url", "completion_callback_url"):
        v = body.get(field)
        if not isinstance(v, str) or not v.startswith(("http://", "https://")):
            return None, field, "must be an http(s) URL"
    v = body.get("grader_callback_url")
    if v is not None and (not isinstance(v, str) or not v.startswith(("http://", "https://"))):
        return None, "grader_callback_url", "must be an http(s) URL or null"
    if body.get("label") is not None and not isinstance(body["label"], str):
        return None, "label", "must be a string or null"
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        return None, "metadata", "must be an object or null"
    for field in ("controller_api_key", "llm_api_key"):
        v = body.get(field)
        if v is not None and not isinstance(v, str):
            return None, field, "must be a string or null"
    if body.get("llm_api_key") == "":
        return None, "llm_api_key", "must not be empty (omit it to use controller_api_key)"
    for field in ("agent_timeout_sec", "grader_timeout_sec"):
        v = body.get(field)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            return None, field, "must be a finite positive number"
    req = dict(body)
    req["rollout_id"] = rid
    return req, None, None


# ---------------------------------------------------------------- HTTP client


def post_json(url: str, body: dict, headers: dict, timeout: float) -> tuple[int, bytes]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    for k, v in headers.items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def bearer(key) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def remaining(ro: Rollout) -> float:
    if ro.deadline is None:
        return 300.0
    left = ro.deadline - time.monotonic()
    if left <= 0:
        raise RolloutError("timeout", "agent_timeout_sec ran out")
    return left


def chat(ro: Rollout, messages: list) -> dict:
    """One LLM call through the controller, retried on 5xx and transport errors."""
    req = ro.req
    key = req.get("llm_api_key") or req.get("controller_api_key")
    headers = {"x-rollout-id": ro.id, "x-sample-id": SAMPLE_ID, **bearer(key)}
    url = req["chat_completions_url"].rstrip("/") + "/chat/completions"
    body = {"model": MODEL, "messages": messages, "tools": TOOLS}
    delay = 0.5
    for attempt in range(4):
        if ro.cancel.is_set():
            raise RolloutError("cancelled", "cancelled")
        try:
            code, data = post_json(url, body, headers, min(remaining(ro), 300.0))
        except (urllib.error.URLError, OSError) as e:
            if ro.deadline is not None and time.monotonic() >= ro.deadline:
                raise RolloutError("timeout", "agent_timeout_sec ran out during an LLM call")
            code, data = 0, str(e).encode()
        if code == 200:
            return json.loads(data)
        if 0 < code < 500 and code != 429:
            raise RolloutError("http_error", f"LLM call failed: HTTP {code}: {data[:200]!r}")
        if attempt < 3:
            time.sleep(min(delay, remaining(ro)))
            delay *= 2
    raise RolloutError("http_error", f"LLM call failed after retries: HTTP {code}: {data[:200]!r}")


def call_tool(call: dict) -> str:
    fn = call.get("function") or {}
    name = fn.get("name")
    try:
        args = json.loads(fn.get("arguments") or "{}")
        a, b = args["a"], args["b"]
    except (ValueError, KeyError, TypeError) as e:
        return f"Error: bad arguments for {name}: {e}"
    if name == "multiply":
        r = a * b
    elif name == "add":
        r = a + b
    else:
        return f"Error: unknown tool {name!r}"
    if isinstance(r, float) and r.is_integer():
        r = int(r)
    return str(r)


# ---------------------------------------------------------------- the rollout


def run_agent(ro: Rollout) -> tuple[list, int]:
    if not os.environ.get("MULTIPLY_SECRET"):
        raise RolloutError("agent_error", "MULTIPLY_SECRET is not set: the rollout needs it ([secrets] required)")
    messages = [dict(m) for m in ro.req["initial_messages"]]
    for turn in range(1, MAX_TURNS + 1):
        if STATE.turn_delay > 0:
            time.sleep(min(STATE.turn_delay, remaining(ro)))
        answer = chat(ro, messages)
        try:
            msg = answer["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise RolloutError("agent_error", "the LLM answer has no choices[0].message")
        messages.append(msg)
        calls = msg.get("tool_calls") or []
        if not calls:
            return messages, turn
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": call_tool(call)})
    raise RolloutError("agent_error", f"no final answer within {MAX_TURNS} turns")


def last_text(messages: list) -> str:
    for m in reversed(messages):
        if m.get("role") == "assistant" and isinstance(m.get("content"), str) and m["content"]:
            return m["content"]
    return ""


def callback(ro: Rollout, url: str, body: dict) -> None:
    """Posts a callback: 5 attempts, backoff 0.5 s doubling, on transport errors and 429/5xx."""
    headers = bearer(ro.req.get("controller_api_key"))
    delay = 0.5
    for attempt in range(5):
        try:
            code, data = post_json(url, body, headers, 10.0)
        except (urllib.error.URLError, OSError) as e:
            code, data = 0, str(e).encode()
        if 200 <= code < 300:
            return
        if code not in (0, 429, 500, 502, 503, 504):
            log(f"rollout {ro.id}: callback refused: HTTP {code}: {data[:200]!r}")
            return
        if attempt < 4:
            time.sleep(delay)
            delay = min(delay * 2, 8.0)
    log(f"rollout {ro.id}: callback failed after 5 attempts: HTTP {code}")


def run_rollout(ro: Rollout) -> None:
    req = ro.req
    messages, turns, status, category, message = [], 0, "success", None, None
    try:
        messages, turns = run_agent(ro)
        if ro.cancel.is_set():
            raise RolloutError("cancelled", "cancelled")
    except RolloutError as e:
        status, category, message = ("cancelled" if e.category == "cancelled" else "failure"), e.category, str(e)
    except Exception as e:  # noqa: BLE001 - any agent failure is an agent_error
        status, category, message = "failure", "agent_error", f"{type(e).__name__}: {e}"
    if status == "cancelled":
        category = None
    ro.status, ro.err_message = ("grading" if status == "success" else status), message
    callback(ro, req["completion_callback_url"], {
        "status": status, "rollout_id": ro.id, "err_message": message, "err_category": category,
    })
    grader_url = req.get("grader_callback_url")
    if grader_url and status != "cancelled":
        label = req.get("label")
        metadata = req.get("metadata")
        if label is None and isinstance(metadata, dict) and metadata.get("ground_truth") is not None:
            label = str(metadata["ground_truth"])
        body = {"status": status, "rollout_id": ro.id, "err_message": message, "err_category": category,
                "sample": None, "samples": {}}
        if status == "success":
            reward = None
            if label is not None:
                reward = 1.0 if label.strip() and label.strip() in last_text(messages) else 0.0
            ro.reward = reward
            if os.environ.get("MULTIPLY_ECHO_SECRET") == "1":
                log("leaking on purpose: MULTIPLY_SECRET=" + os.environ["MULTIPLY_SECRET"])
                messages = messages + [{"role": "system", "content": "debug token " + os.environ["MULTIPLY_SECRET"]}]
            sample = {
                "id": SAMPLE_ID, "messages": messages, "label": label, "reward": reward,
                "remove_sample": False, "metrics": {"num_turns": turns},
                "extra_fields": {"greeting": os.environ.get("MULTIPLY_GREETING"), "server_pid": os.getpid()},
            }
            # Both shapes: a v0.3 controller reads "sample", a v0.2 one "samples".
            body["sample"], body["samples"] = sample, {SAMPLE_ID: sample}
        callback(ro, grader_url, body)
    ro.status = status
    with STATE.lock:
        STATE.running -= 1
    log(f"rollout {ro.id}: {status}" + (f" reward={ro.reward}" if status == "success" else f" {category}: {message}"))


# ---------------------------------------------------------------- HTTP server


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # request lines stay quiet
        pass

    def reply(self, code: int, body, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        try:
            return json.loads(self.rfile.read(n) or b"null")
        except ValueError:
            return ValueError

    def invalid(self, field: str, msg: str) -> None:
        self.reply(422, {"detail": [{"loc": ["body", field], "msg": f"{field} {msg}", "type": "value_error"}]})

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path == "/health":
            with STATE.lock:
                running = STATE.running
            iid = os.environ.get("_OSMOSIS_ROLLOUT_INSTANCE_ID", "")
            self.reply(200, {
                "status": "ok", "instance_id": iid or None, "pid": os.getpid(),
                "concurrency": {"max_concurrent": STATE.max_concurrent, "queued": 0, "running": running},
            }, {INSTANCE_HEADER: iid} if iid else None)
            return
        m = re.fullmatch(r"/rollout/([^/]+)/status", path)
        if m:
            rid = urllib.request.unquote(m.group(1))
            with STATE.lock:
                ro = STATE.rollouts.get(rid)
            if ro is None:
                self.reply(200, {"rollout_id": rid, "status": "unknown", "reward": None, "err_message": None})
            else:
                self.reply(200, {"rollout_id": rid, "status": ro.status, "reward": ro.reward, "err_message": ro.err_message})
            return
        self.reply(404, {"detail": "Not Found"})

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        body = self.body()
        if body is ValueError:
            self.invalid("body", "is not valid JSON")
            return
        if path == "/rollout":
            self.start(body)
        elif path == "/rollout/cancel":
            self.cancel(body)
        else:
            self.reply(404, {"detail": "Not Found"})

    def start(self, body) -> None:
        req, field, msg = validate(body)
        if req is None:
            self.invalid(field, msg)
            return
        with STATE.lock:
            if STATE.stopping.is_set():
                self.reply(503, {"detail": "shutting down"})
                return
            if req["rollout_id"] in STATE.rollouts:
                self.reply(202, {})  # a duplicate starts nothing new
                return
            if STATE.running >= STATE.max_concurrent:
                self.reply(429, {"detail": "at capacity"}, {"Retry-After": str(STATE.retry_after)})
                return
            ro = Rollout(req)
            STATE.rollouts[ro.id] = ro
            STATE.running += 1
            STATE.accepted += 1
            crash = STATE.crash_after > 0 and STATE.accepted >= STATE.crash_after
        self.reply(202, {})
        self.wfile.flush()
        log(f"rollout {ro.id}: accepted ({len(req['initial_messages'])} messages)")
        if crash:
            # The rollout was accepted and never finishes: the process dies
            # holding it.
            log(f"MULTIPLY_CRASH_AFTER={STATE.crash_after} reached: exiting")
            os._exit(3)
        threading.Thread(target=run_rollout, args=(ro,), daemon=True).start()

    def cancel(self, body) -> None:
        if not isinstance(body, dict):
            self.invalid("body", "must be a JSON object")
            return
        given = [k for k in ("ids", "prefix", "all") if body.get(k) is not None]
        if len(given) != 1:
            self.invalid("body", "needs exactly one of ids, prefix, all")
            return
        with STATE.lock:
            if "ids" in given:
                if not isinstance(body["ids"], list):
                    self.invalid("ids", "must be a list")
                    return
                targets = {rid: STATE.rollouts.get(rid) for rid in body["ids"]}
            elif "prefix" in given:
                targets = {rid: ro for rid, ro in STATE.rollouts.items() if rid.startswith(str(body["prefix"]))}
            else:
                targets = dict(STATE.rollouts)
        out = {}
        for rid, ro in targets.items():
            if ro is None or ro.status in TERMINAL:
                out[rid] = "not_found"
            else:
                ro.cancel.set()
                out[rid] = "cancelled_running"
        self.reply(200, {"dispositions": out})


def main() -> None:
    port = int(os.environ.get("_OSMOSIS_ROLLOUT_PORT", "8000"))
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True

    def stop(signum, frame):
        STATE.stopping.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(f"multiply rollout server listening on http://127.0.0.1:{port}")
    server.serve_forever(poll_interval=0.1)
    server.server_close()
    # Running rollouts are cancelled: each still posts its completion.
    with STATE.lock:
        live = [ro for ro in STATE.rollouts.values() if ro.status not in TERMINAL]
    for ro in live:
        ro.cancel.set()
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        with STATE.lock:
            if STATE.running == 0:
                break
        time.sleep(0.05)
    log("stopped")
    sys.exit(0)


if __name__ == "__main__":
    main()
