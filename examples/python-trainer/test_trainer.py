"""Tests of trainer.py against a stand-in for osmo's row stream.

Run: python3 -m unittest discover -s examples/python-trainer -v
"""

import http.server
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trainer  # noqa: E402

IM_END = 151645


def make_rows(rollouts=6, samples=2):
    """Rows as osmo streams them: per rollout, each sample's rows in order
    (sample 1 of every third rollout forked in two), each with its cursor."""
    rows = []
    for r in range(rollouts):
        for s in range(samples):
            nrows = 2 if (r % 3 == 0 and s == 1) else 1
            for k in range(nrows):
                prompt = [1, 2, 3 + r] + [4] * k
                completion = [10 + s, 11 + r, IM_END]
                rows.append({
                    "rollout_id": "ro-%d" % r, "sample_id": "s-%d" % s, "row": k,
                    "token_ids": prompt + completion,
                    "loss_mask": [0] * len(prompt) + [1] * len(completion),
                    "logprobs": [0.0] * len(prompt) + [-0.5, -0.25, -0.125],
                    "reward": float((r + s) % 3) / 2,
                    "merge": "exact" if k == 0 else "forked",
                    "calls": [k],
                })
    for i, row in enumerate(rows):
        row["cursor"] = "c%d" % (i + 1)
    return rows


class StreamServer:
    """GET /v1/rows:stream?after=CURSOR: the rows after the cursor, one JSON
    line each (the gateway's {"result": row} when wrap), a pause after each
    rollout, then the connection is held open as osmo holds a stream open
    while no rollout finishes. A garbage cursor answers 400."""

    def __init__(self, rows, pause=0.0, wrap=False, hold=0.3, cut_after=None, error_line=None):
        self.rows, self.pause, self.wrap, self.hold = rows, pause, wrap, hold
        # cut_after: the first stream's connection is cut after that many
        # rows, without ending its answer; error_line: the first stream
        # ends with that line instead.
        self.cut_after, self.error_line = cut_after, error_line
        self.requests = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                u = urllib.parse.urlsplit(self.path)
                q = urllib.parse.parse_qs(u.query, keep_blank_values=True)
                after = q.get("after", [""])[0]
                outer.requests.append((u.path, after, self.headers.get("Authorization")))
                if u.path != "/v1/rows:stream":
                    self.send_error(404)
                    return
                cursors = [r["cursor"] for r in outer.rows]
                if after and after not in cursors:
                    body = json.dumps({"code": 3, "message": "after: not a cursor of this stream"}).encode()
                    self.send_response(400)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                start = cursors.index(after) + 1 if after else 0
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                first = len(outer.requests) == 1
                try:
                    prev = None
                    for i, row in enumerate(outer.rows[start:]):
                        if first and outer.cut_after is not None and i == outer.cut_after:
                            self.wfile.flush()
                            self.connection.shutdown(2)
                            self.close_connection = True
                            return
                        if first and outer.error_line is not None and i == 3:
                            line = outer.error_line.encode() + b"\n"
                            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(line), line))
                            return
                        if prev is not None and row["rollout_id"] != prev and outer.pause:
                            time.sleep(outer.pause)
                        prev = row["rollout_id"]
                        line = json.dumps({"result": row} if outer.wrap else row).encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    time.sleep(outer.hold)
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def read_steps(state_dir):
    with open(os.path.join(state_dir, trainer.STEPS), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class TensorsTest(unittest.TestCase):
    def test_advantages_normalized_per_group(self):
        rows = make_rows(rollouts=3, samples=3)
        adv, groups = trainer.advantages(rows)
        self.assertEqual(sorted(groups), ["ro-0", "ro-1", "ro-2"])
        for g, samples in groups.items():
            self.assertEqual(len(samples), 3, g)  # a forked sample counts once
            vals = [adv[s] for s in samples]
            self.assertAlmostEqual(sum(vals), 0.0, places=9)
            mean = sum(vals) / 3
            self.assertAlmostEqual(sum((v - mean) ** 2 for v in vals) / 3, 1.0, places=4)
        # Rewards (r+s)%3/2 in rollout 0: 0, 0.5, 1 → -1.2247, 0, 1.2247.
        self.assertAlmostEqual(adv["ro-0/s-0"], -1.224744, places=4)
        self.assertAlmostEqual(adv["ro-0/s-1"], 0.0, places=6)

    def test_a_group_of_equal_rewards_has_no_advantage(self):
        rows = make_rows(rollouts=1, samples=1)
        adv, _ = trainer.advantages(rows)
        self.assertEqual(adv, {"ro-0/s-0": 0.0})

    def test_group_by_dataset_row(self):
        rows = make_rows(rollouts=4, samples=1)
        for i, r in enumerate(rows):
            r["row_index"] = i % 2
        adv, groups = trainer.advantages(rows, "row_index")
        self.assertEqual(sorted(groups), ["row 0", "row 1"])
        for samples in groups.values():
            self.assertEqual(len(samples), 2)
            self.assertAlmostEqual(sum(adv[s] for s in samples), 0.0, places=9)
        del rows[0]["row_index"]
        with self.assertRaises(trainer.StreamError):
            trainer.advantages(rows, "row_index")

    def test_group_by_pattern(self):
        rows = make_rows(rollouts=4, samples=1)
        for i, r in enumerate(rows):
            r["rollout_id"] = "p%d-k%d" % (i % 2, i)
        adv, groups = trainer.advantages(rows, re.compile(r"^(.*)-k[0-9]+$"))
        self.assertEqual(sorted(groups), ["p0", "p1"])
        for samples in groups.values():
            self.assertAlmostEqual(sum(adv[s] for s in samples), 0.0, places=9)
        with self.assertRaises(trainer.StreamError):
            trainer.advantages(rows, re.compile(r"^q"))

    def test_batch_tensors(self):
        rows = make_rows(rollouts=1, samples=2)  # sample 1 forked: 3 rows
        rows.append(dict(rows[0], sample_id="s-removed", reward=None))
        t = trainer.batch_tensors(rows, pad_id=-1)
        self.assertEqual(len(t["input_ids"]), 3, "the removed sample is not trained on")
        width = max(len(r["token_ids"]) for r in rows[:3])
        for i, r in enumerate(rows[:3]):
            n = len(r["token_ids"])
            for key in ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "advantages"):
                self.assertEqual(len(t[key][i]), width, key)
            self.assertEqual(t["input_ids"][i], r["token_ids"] + [-1] * (width - n))
            self.assertEqual(t["attention_mask"][i], [1] * n + [0] * (width - n))
            self.assertEqual(t["loss_mask"][i], r["loss_mask"] + [0] * (width - n))
            self.assertEqual(t["old_logprobs"][i][:n], r["logprobs"])
            a = t["sample_advantages"]["ro-0/" + r["sample_id"]]
            self.assertEqual(t["advantages"][i], [a * m for m in r["loss_mask"]] + [0.0] * (width - n))
        self.assertNotEqual(t["advantages"][0], t["advantages"][1])

    def test_bad_rows_are_refused(self):
        good = make_rows(rollouts=1, samples=1)[0]
        for name, bad in [
            ("lengths", dict(good, logprobs=good["logprobs"][:-1])),
            ("mask", dict(good, loss_mask=[2] * len(good["loss_mask"]))),
            ("no tokens", {k: v for k, v in good.items() if k != "token_ids"}),
        ]:
            with self.subTest(name), self.assertRaises(trainer.StreamError):
                trainer.decode_row(json.dumps(bad))
        with self.assertRaises(trainer.StreamError):
            trainer.decode_row('{"error": {"code": 3, "message": "after: garbage"}}')
        with self.assertRaises(trainer.StreamError):
            trainer.decode_row("not json")
        self.assertEqual(trainer.decode_row(json.dumps({"result": good})), good)

    def test_batches_take_whole_rollouts(self):
        rows = make_rows(rollouts=4, samples=2)  # rollouts of 3, 2, 2, 3 rows
        got = list(trainer.batches(rows, 4))
        self.assertEqual([len(b) for b in got], [5, 5])
        for b in got:
            self.assertNotIn(b[-1]["rollout_id"], {r["rollout_id"] for g in got if g is not b for r in g})
        # Idle ends a step.
        got = list(trainer.batches(rows[:3] + [None] + rows[3:5], 100))
        self.assertEqual([len(b) for b in got], [3, 2])


class StateTest(unittest.TestCase):
    def test_a_step_logged_but_not_committed_is_dropped(self):
        d = tempfile.mkdtemp()
        s = trainer.State(d)
        s.commit({"step": 0, "rows": ["a"]}, "c1", 1)
        s.commit({"step": 1, "rows": ["b"]}, "c2", 1)
        # A kill between the log and the state: step 2 logged, not committed.
        with open(os.path.join(d, trainer.STEPS), "a", encoding="utf-8") as f:
            f.write('{"step": 2, "rows": ["c"]}\n{"step": 3, "ro')
        s = trainer.State(d)
        self.assertEqual((s.cursor, s.steps, s.rows), ("c2", 2, 2))
        self.assertEqual([r["step"] for r in read_steps(d)], [0, 1])


class StreamTest(unittest.TestCase):
    def run_main(self, *args):
        out, err = io.StringIO(), io.StringIO()
        old = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        try:
            code = trainer.main(list(args))
        finally:
            sys.stdout, sys.stderr = old
        return code, out.getvalue(), err.getvalue()

    def test_streams_resumes_and_takes_every_row_once(self):
        rows = make_rows(rollouts=8, samples=2)
        for wrap in (False, True):
            with self.subTest(wrap=wrap):
                srv = StreamServer(rows, wrap=wrap)
                self.addCleanup(srv.close)
                d = tempfile.mkdtemp()
                args = ["--url", srv.url, "--state", d, "--batch-rows", "4", "--idle", "0.2", "--api-key", "k"]
                code, out, err = self.run_main(*args, "--max-steps", "2")
                self.assertEqual(code, 0, err)
                self.assertEqual(out.count("step "), 2, out)
                code, out, err = self.run_main(*args, "--max-rows", str(len(rows)))
                self.assertEqual(code, 0, err)
                self.assertIn("resuming after step 2", err)
                steps = read_steps(d)
                seen = [k for s in steps for k in s["rows"]]
                self.assertEqual(seen, [trainer.row_key(r) for r in rows])
                # The second run resumed after the first's last cursor; a
                # stream that ended early (a slow machine past the stand-in's
                # hold) was resumed from a committed step's cursor.
                asked = [a for _, a, _ in srv.requests]
                self.assertEqual(asked[:2], ["", steps[1]["cursor"]])
                committed = {s["cursor"] for s in steps}
                for a in asked[2:]:
                    self.assertIn(a, committed)
                self.assertEqual(srv.requests[0][2], "Bearer k")
                for s in steps:
                    for g, total in s["group_advantage_sums"].items():
                        self.assertAlmostEqual(total, 0.0, places=9, msg=g)
                    self.assertEqual(s["rows"][-1].split("/")[0], [r for r in rows if r["cursor"] == s["cursor"]][0]["rollout_id"])

    def test_a_garbage_cursor_is_a_clear_error(self):
        srv = StreamServer(make_rows(rollouts=1))
        self.addCleanup(srv.close)
        d = tempfile.mkdtemp()
        with open(os.path.join(d, trainer.STATE), "w", encoding="utf-8") as f:
            json.dump({"cursor": "garbage", "steps": 0, "rows": 0}, f)
        code, _, err = self.run_main("--url", srv.url, "--state", d, "--idle", "0.2")
        self.assertEqual(code, 1)
        self.assertIn("answered 400", err)
        self.assertIn("after: not a cursor", err)

    def test_no_server(self):
        code, _, err = self.run_main("--url", "http://127.0.0.1:9", "--state", tempfile.mkdtemp(), "--give-up", "0.5")
        self.assertEqual(code, 1)
        self.assertIn("GET http://127.0.0.1:9/v1/rows:stream", err)
        self.assertIn("giving up", err)

    def test_a_cut_stream_resumes_on_another_replica(self):
        """The first replica's stream is cut in the middle of a rollout:
        the step being gathered is dropped, and the trainer resumes from
        its committed cursor on the second replica; every row is taken
        once, and every rollout's rows in one step."""
        rows = make_rows(rollouts=6, samples=2)
        cut = next(i for i in range(5, len(rows)) if rows[i]["rollout_id"] == rows[i - 1]["rollout_id"])
        a, b = StreamServer(rows, cut_after=cut), StreamServer(rows, hold=5)
        self.addCleanup(a.close)
        self.addCleanup(b.close)
        d = tempfile.mkdtemp()
        code, _, err = self.run_main("--url", a.url + "," + b.url, "--state", d, "--batch-rows", "4", "--idle", "0.5",
                                     "--max-rows", str(len(rows)))
        self.assertEqual(code, 0, err)
        self.assertIn("resuming after", err)
        steps = read_steps(d)
        self.assertEqual([k for st in steps for k in st["rows"]], [trainer.row_key(r) for r in rows])
        for st in steps:
            ids = [k.split("/")[0] for k in st["rows"]]
            for other in steps:
                if other is not st:
                    self.assertFalse(set(ids) & {k.split("/")[0] for k in other["rows"]}, "a rollout split across steps")
        self.assertEqual(len(a.requests), 1)
        self.assertEqual([after for _, after, _ in b.requests], [steps[0]["cursor"]])

    def test_an_error_line(self):
        rows = make_rows(rollouts=4, samples=1)
        for code, retried in ((14, True), (3, False)):
            with self.subTest(code=code):
                srv = StreamServer(rows, hold=5, error_line=json.dumps({"error": {"code": code, "message": "stream error %d" % code}}))
                self.addCleanup(srv.close)
                d = tempfile.mkdtemp()
                rc, _, err = self.run_main("--url", srv.url, "--state", d, "--batch-rows", "1", "--idle", "0.5",
                                           "--max-rows", str(len(rows)), "--give-up", "2")
                self.assertIn("stream error %d" % code, err)
                if retried:
                    self.assertEqual(rc, 0, err)
                    self.assertEqual([k for st in read_steps(d) for k in st["rows"]], [trainer.row_key(r) for r in rows])
                else:
                    self.assertEqual(rc, 1, err)
                    self.assertEqual(len(srv.requests), 1)

    def test_killed_mid_stream_and_restarted(self):
        """The trainer process killed (SIGKILL) while a stream goes, then
        started again: every row is in exactly one committed step."""
        rows = make_rows(rollouts=12, samples=2)
        srv = StreamServer(rows, pause=0.05, hold=0.5)
        self.addCleanup(srv.close)
        d = tempfile.mkdtemp()
        argv = [sys.executable, trainer.__file__, "--url", srv.url, "--state", d, "--batch-rows", "2", "--idle", "0.3"]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.time() + 20
        while time.time() < deadline:
            if os.path.exists(os.path.join(d, trainer.STEPS)) and len(read_steps(d)) >= 3:
                break
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=10)
        killed_at = len(read_steps(d))
        self.assertGreaterEqual(killed_at, 3)
        res = subprocess.run(argv + ["--max-rows", str(len(rows))], capture_output=True, text=True, timeout=30)
        self.assertEqual(res.returncode, 0, res.stderr)
        seen = [k for s in read_steps(d) for k in s["rows"]]
        self.assertEqual(seen, [trainer.row_key(r) for r in rows])
        # Each run asked from its committed cursor: the first from the
        # start, every later request (the restart, and a resume after a
        # stream that ended early on a slow machine) from a committed step.
        asked = [a for _, a, _ in srv.requests]
        self.assertGreaterEqual(len(asked), 2)
        self.assertEqual(asked[0], "")
        committed = {s["cursor"] for s in read_steps(d)}
        for a in asked[1:]:
            self.assertIn(a, committed)

    def test_rows_file(self):
        rows = make_rows(rollouts=4, samples=2)
        for i, r in enumerate(rows):
            r["row_index"], r["run_index"] = int(r["rollout_id"][3:]) % 2, 0
            del r["cursor"]
        d = tempfile.mkdtemp()
        path = os.path.join(d, "rows.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        state = os.path.join(d, "state")
        code, out, err = self.run_main("--rows-file", path, "--state", state, "--batch-rows", "3", "--group-by", "row_index", "--max-steps", "1")
        self.assertEqual(code, 0, err)
        code, out, err = self.run_main("--rows-file", path, "--state", state, "--batch-rows", "3", "--group-by", "row_index")
        self.assertEqual(code, 0, err)
        seen = [k for s in read_steps(state) for k in s["rows"]]
        self.assertEqual(seen, [trainer.row_key(r) for r in rows])


if __name__ == "__main__":
    unittest.main()
