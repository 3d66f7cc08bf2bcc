#!/usr/bin/env python3
"""A trainer's side of osmo's training rows, in the Python standard library.

It streams rows of finished rollouts from a running osmo
(GET /v1/rows:stream?after=CURSOR, one JSON row per line), or reads an
eval's rows.jsonl, and turns each batch into the tensors a PPO or GRPO step
takes, as plain lists:

  input_ids       the rows' token ids, right-padded with --pad-id
  attention_mask  1 on real tokens, 0 on padding
  loss_mask       1 exactly on the tokens the policy generated
  old_logprobs    the policy's log probability of each token (0 off the mask)
  advantages      each sample's reward normalized within its group (the
                  rollout; the dataset row with --group-by row_index; or
                  the rollouts of one prompt, named by --group-pattern),
                  on the loss-masked tokens, 0 elsewhere

A real trainer hands these to its model; this one prints a summary line per
step. It resumes after its own restart: a step is committed when its state
file (cursor and step count) is replaced, and steps.jsonl, where each step
records the rows it took, is cut back to the committed steps on start. A
killed trainer therefore redoes at most the step it was in, and never
trains on a row twice or skips one.

A step takes whole rollouts: rows of one rollout arrive together, and the
step ends at the first row of another rollout once it holds --batch-rows
rows, or when the stream has been idle for --idle seconds. When the stream
breaks or ends (a replica shutting down, a cut connection) the step being
gathered is dropped and the trainer resumes from its committed cursor, on
the next of the --url replicas.
"""

import argparse
import http.client
import json
import math
import os
import queue
import re
import socket
import sys
import threading
import time
import urllib.parse

STATE = "state.json"
STEPS = "steps.jsonl"


class StreamError(Exception):
    """The server refused the stream, or sent something that is not a row."""


class StreamBroken(StreamError):
    """The stream could not be had or ended early (no server, a replica
    shutting down, a cut connection): the trainer resumes from its
    committed cursor, on the next --url."""


# gRPC codes (as the REST gateway writes them) that say a request is
# wrong, not that the server is away: retrying them cannot help.
FATAL_CODES = {3, 5, 7, 9, 12, 16}


# --- reading rows -----------------------------------------------------------


def stream_rows(base_url, after, merge="", api_key="", idle=5.0, timeout=30.0):
    """Yields the rows osmo streams after cursor `after`, then None each
    time the stream has been idle for `idle` seconds (so the caller can end
    a step). A row is a dict with the API's Row fields."""
    query = {"after": after}
    if merge:
        query["merge"] = merge
    u = urllib.parse.urlsplit(base_url.rstrip("/") + "/v1/rows:stream?" + urllib.parse.urlencode(query))
    conn_type = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(u.netloc, timeout=timeout)
    headers = {"Accept": "application/x-ndjson, application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    url = urllib.parse.urlunsplit(u)
    try:
        conn.request("GET", u.path + "?" + u.query, headers=headers)
        sock = conn.sock  # the response keeps it; the connection may let go
        resp = conn.getresponse()
    except OSError as e:
        conn.close()
        raise StreamBroken("GET %s: %s" % (url, e)) from None
    if resp.status != 200:
        body = resp.read(4096).decode("utf-8", "replace").strip()
        conn.close()
        kind = StreamBroken if resp.status >= 500 or resp.status == 429 else StreamError
        raise kind("GET %s answered %d: %s" % (url, resp.status, body))
    # The timeout bounds connecting and the answer's head; rows may then be
    # minutes apart. The connection is read in a thread of its own, so that
    # waiting for a row can end a step (a timed-out read cannot resume).
    sock.settimeout(None)
    lines = queue.Queue(maxsize=1024)

    def read():
        try:
            for line in resp:
                lines.put(line)
            lines.put(_END)
        except Exception as e:  # handed to the consumer
            lines.put(e)

    threading.Thread(target=read, daemon=True).start()
    try:
        while True:
            try:
                line = lines.get(timeout=idle)
            except queue.Empty:
                yield None
                continue
            if line is _END:
                raise StreamBroken("the stream from %s ended" % url)
            if isinstance(line, Exception):
                raise StreamBroken("the stream from %s broke: %s" % (url, line))
            line = line.strip()
            if line:
                row = decode_row(line)
                if not row.get("cursor"):
                    raise StreamError("row %s has no cursor to resume after" % row_key(row))
                yield row
    finally:
        # Shut down first: the reader thread holds the response while it
        # waits on the socket, and closing the response would wait for it.
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()


_END = object()


def decode_row(line):
    """A row from one line of the stream. A line may be the row itself or,
    as grpc-gateway writes a server stream, {"result": row} or {"error": …}."""
    try:
        obj = json.loads(line)
    except ValueError:
        raise StreamError("a line of the stream is not JSON: %r" % line[:200]) from None
    if not isinstance(obj, dict):
        raise StreamError("a line of the stream is not an object: %r" % line[:200])
    if "error" in obj and "token_ids" not in obj:
        err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
        kind = StreamError if err.get("code") in FATAL_CODES else StreamBroken
        raise kind("the stream ended with an error: %s" % (err.get("message") or json.dumps(err)))
    if "result" in obj and "token_ids" not in obj:
        obj = obj["result"]
    check_row(obj)
    return obj


def check_row(row):
    """Refuses a row a step cannot take: arrays of different lengths, a
    mask that is not 0/1, no cursor to resume after."""
    for key in ("rollout_id", "token_ids", "loss_mask", "logprobs"):
        if key not in row:
            raise StreamError("a row without %s: %s" % (key, json.dumps(row)[:200]))
    n = len(row["token_ids"])
    if len(row["loss_mask"]) != n or len(row["logprobs"]) != n:
        raise StreamError("row %s/%s/%s: token_ids, loss_mask and logprobs have lengths %d, %d, %d"
                          % (row.get("rollout_id"), row.get("sample_id"), row.get("row", 0), n, len(row["loss_mask"]), len(row["logprobs"])))
    if any(m not in (0, 1) for m in row["loss_mask"]):
        raise StreamError("row %s: loss_mask holds a value other than 0 and 1" % row.get("rollout_id"))


def file_rows(path):
    """Yields the rows of a JSON-lines file (an eval's rows.jsonl)."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if line:
                try:
                    row = json.loads(line)
                except ValueError:
                    raise StreamError("%s:%d: not JSON" % (path, i + 1)) from None
                check_row(row)
                yield row


def row_key(row):
    return "%s/%s/%d" % (row["rollout_id"], row.get("sample_id", ""), row.get("row", 0))


# --- tensors ----------------------------------------------------------------


def group_of(row, group_by):
    if isinstance(group_by, re.Pattern):
        m = group_by.search(row["rollout_id"])
        if not m:
            raise StreamError("--group-pattern %r does not match rollout %s" % (group_by.pattern, row["rollout_id"]))
        return m.group(1) if m.groups() else m.group(0)
    if group_by == "row_index":
        if "row_index" not in row:
            raise StreamError("--group-by row_index: row %s has no row_index (only an eval's rows.jsonl has it)" % row_key(row))
        return "row %s" % row["row_index"]
    return row["rollout_id"]


def advantages(rows, group_by="rollout", eps=1e-6):
    """Each sample's advantage: its reward minus its group's mean reward,
    over the group's standard deviation (GRPO's normalization). A sample
    counts once however many rows it has; a group of one sample, or whose
    rewards are all equal, has advantage 0. Returns {sample key: advantage}
    and the groups {group: [sample keys]}."""
    rewards, groups = {}, {}
    for row in rows:
        sample = "%s/%s" % (row["rollout_id"], row.get("sample_id", ""))
        if sample not in rewards:
            rewards[sample] = float(row["reward"])
            groups.setdefault(group_of(row, group_by), []).append(sample)
    adv = {}
    for samples in groups.values():
        rs = [rewards[s] for s in samples]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
        for s in samples:
            adv[s] = 0.0 if std < eps else (rewards[s] - mean) / (std + eps)
    return adv, groups


def batch_tensors(rows, pad_id=0, group_by="rollout"):
    """The tensors of a step from its rows (those with a reward: a sample
    without one, removed by its grader, is not trained on)."""
    rows = [r for r in rows if r.get("reward") is not None]
    adv, groups = advantages(rows, group_by)
    width = max((len(r["token_ids"]) for r in rows), default=0)
    out = {"input_ids": [], "attention_mask": [], "loss_mask": [], "old_logprobs": [], "advantages": [],
           "sample_advantages": adv, "groups": groups}
    for r in rows:
        n, pad = len(r["token_ids"]), width - len(r["token_ids"])
        a = adv["%s/%s" % (r["rollout_id"], r.get("sample_id", ""))]
        out["input_ids"].append(list(r["token_ids"]) + [pad_id] * pad)
        out["attention_mask"].append([1] * n + [0] * pad)
        out["loss_mask"].append(list(r["loss_mask"]) + [0] * pad)
        out["old_logprobs"].append([lp if m else 0.0 for lp, m in zip(r["logprobs"], r["loss_mask"])] + [0.0] * pad)
        out["advantages"].append([a if m else 0.0 for m in r["loss_mask"]] + [0.0] * pad)
    return out


# --- state ------------------------------------------------------------------


def write_atomic(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class State:
    """The committed cursor and steps, in dir: state.json is the commit
    point, steps.jsonl the record of each committed step."""

    def __init__(self, dir):
        self.dir = dir
        os.makedirs(dir, exist_ok=True)
        self.cursor, self.steps, self.rows = "", 0, 0
        path = os.path.join(dir, STATE)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                s = json.load(f)
            self.cursor, self.steps, self.rows = s.get("cursor", ""), int(s.get("steps", 0)), int(s.get("rows", 0))
        self._trim_steps()

    def _trim_steps(self):
        """Keeps the first self.steps whole lines of steps.jsonl: a step
        logged but not committed (a kill in between) is done again."""
        path = os.path.join(self.dir, STEPS)
        keep = []
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if len(keep) == self.steps or not line.endswith("\n"):
                        break
                    keep.append(line)
        if len(keep) < self.steps:
            raise RuntimeError("%s holds %d steps, %s says %d were committed" % (path, len(keep), STATE, self.steps))
        write_atomic(path, "".join(keep))

    def commit(self, record, cursor, nrows):
        with open(os.path.join(self.dir, STEPS), "a", encoding="utf-8") as f:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.cursor, self.steps, self.rows = cursor, self.steps + 1, self.rows + nrows
        write_atomic(os.path.join(self.dir, STATE),
                     json.dumps({"cursor": self.cursor, "steps": self.steps, "rows": self.rows}) + "\n")


# --- the loop -----------------------------------------------------------------


def step_record(step, rows, t, group_by):
    """What a step logs: the rows it took, the shapes and sums a test (or a
    person) can check, and each group's advantage sum (0 up to rounding)."""
    group_sums = {g: sum(t["sample_advantages"][s] for s in samples) for g, samples in t["groups"].items()}
    masked = sum(sum(m) for m in t["loss_mask"])
    return {
        "step": step,
        "rows": [row_key(r) for r in rows],
        "trained_rows": len(t["input_ids"]),
        "width": len(t["input_ids"][0]) if t["input_ids"] else 0,
        "lengths": [sum(m) for m in t["attention_mask"]],
        "loss_tokens": masked,
        "mean_old_logprob": (sum(sum(r) for r in t["old_logprobs"]) / masked) if masked else 0.0,
        "group_by": group_by.pattern if isinstance(group_by, re.Pattern) else group_by,
        "group_advantage_sums": group_sums,
        "advantages": t["sample_advantages"],
        "cursor": rows[-1].get("cursor", ""),
    }


def batches(rows, batch_rows):
    """Groups rows into steps of whole rollouts: a step closes at the first
    row of another rollout once it holds batch_rows rows, when the source
    goes idle (None) or at its end. A source that breaks (StreamBroken)
    drops the step being gathered: its rows come again on resuming."""
    batch = []
    for row in rows:
        if row is None:
            if batch:
                yield batch
                batch = []
            continue
        if batch and len(batch) >= batch_rows and row["rollout_id"] != batch[-1]["rollout_id"]:
            yield batch
            batch = []
        batch.append(row)
    if batch:
        yield batch


def train(rows, state, batch_rows, pad_id, group_by, out, max_steps=0, max_rows=0):
    """Runs a step per batch of rows; returns True once max_steps steps or
    max_rows rows are committed (0: no bound)."""
    for batch in batches(rows, batch_rows):
        t = batch_tensors(batch, pad_id, group_by)
        rec = step_record(state.steps, batch, t, group_by)
        # Here a real trainer runs its PPO/GRPO step on t, then commits.
        state.commit(rec, rec["cursor"] or state.cursor, len(batch))
        print("step %d: %d rows (%d trained, width %d, %d loss tokens), mean old logprob %.4f, %d groups, cursor %s"
              % (rec["step"], len(batch), rec["trained_rows"], rec["width"], rec["loss_tokens"],
                 rec["mean_old_logprob"], len(t["groups"]), rec["cursor"] or "-"), file=out, flush=True)
        if (max_steps and state.steps >= max_steps) or (max_rows and state.rows >= max_rows):
            return True
    return False


def train_stream(urls, state, args, group_by, out, err, sleep=time.sleep, clock=time.monotonic):
    """Trains on osmo's row stream, resuming from the committed cursor
    whenever the stream breaks or ends, on the next of urls (replicas share
    the stream's state), after a pause that doubles up to 5s. It gives up
    when no row came for args.give_up seconds of trying."""
    i, pause, last_row = 0, 0.2, clock()

    def seen(rows):
        nonlocal last_row, pause
        for row in rows:
            if row is not None:
                last_row, pause = clock(), 0.2
            yield row

    while True:
        url = urls[i % len(urls)]
        try:
            rows = stream_rows(url, state.cursor, args.merge, args.api_key, args.idle)
            if train(seen(rows), state, args.batch_rows, args.pad_id, group_by, out, args.max_steps, args.max_rows):
                return
        except StreamBroken as e:
            if clock() - last_row > args.give_up:
                raise StreamError("%s; no row for %gs, giving up" % (e, args.give_up)) from None
            i += 1
            print("trainer: %s; resuming after %s on %s in %.1fs" % (e, state.cursor or "(start)", urls[i % len(urls)], pause),
                  file=err, flush=True)
            sleep(pause)
            pause = min(pause * 2, 5.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="osmo's REST base URL (streams GET /v1/rows:stream); several, comma-separated, are "
                                   "replicas tried in turn when a stream breaks")
    src.add_argument("--rows-file", help="an eval's rows.jsonl, read in place of a stream")
    ap.add_argument("--state", required=True, help="directory of the trainer's state (cursor, steps)")
    ap.add_argument("--api-key", default=os.environ.get("OSMO_API_KEY", ""), help="bearer for osmo's API (env OSMO_API_KEY)")
    ap.add_argument("--merge", default="", choices=["", "exact", "realign"], help="the rows' merge mode (default: exact)")
    ap.add_argument("--batch-rows", type=int, default=8, help="rows a step takes at least, whole rollouts (8)")
    ap.add_argument("--group-by", default="rollout", choices=["rollout", "row_index"],
                    help="the advantage's group: the rollout (its samples) or the dataset row (rows.jsonl of an eval)")
    ap.add_argument("--group-pattern", type=re.compile,
                    help="a regular expression whose first group, in the rollout id, names the advantage's group: the "
                         "rollouts a trainer started for one prompt (e.g. '^(.*)-k[0-9]+$'); overrides --group-by")
    ap.add_argument("--pad-id", type=int, default=0, help="the id input_ids are padded with (0)")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds without a row that end a step (5)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many committed steps (0: never)")
    ap.add_argument("--max-rows", type=int, default=0, help="stop once this many rows are committed (0: never)")
    ap.add_argument("--give-up", type=float, default=300.0,
                    help="seconds without a row, while the stream keeps breaking, after which the trainer exits 1 (300)")
    args = ap.parse_args(argv)
    if args.batch_rows < 1:
        ap.error("--batch-rows must be at least 1")
    state = State(args.state)
    print("resuming after step %d, %d rows, cursor %s" % (state.steps, state.rows, state.cursor or "(start)")
          if state.steps else "starting", file=sys.stderr, flush=True)
    try:
        group_by = args.group_pattern or args.group_by
        if args.rows_file:
            rows = file_rows(args.rows_file)
            # A file has no cursor: the committed rows are skipped.
            rows = (r for i, r in enumerate(rows) if i >= state.rows)
            train(rows, state, args.batch_rows, args.pad_id, group_by, sys.stdout, args.max_steps, args.max_rows)
        else:
            urls = [u.strip() for u in args.url.split(",") if u.strip()]
            train_stream(urls, state, args, group_by, sys.stdout, sys.stderr)
    except StreamError as e:
        print("trainer: %s" % e, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
