"""An exec agent that makes one chat call through the rollout's proxy, then
prints a last line that is not JSON: the conversation the proxy recorded
must stand for the sample."""

import json
import os
import sys
import urllib.request

task = json.load(sys.stdin)
body = json.dumps({"model": "openai/osmosis-rollout", "messages": task["prompt"]}).encode()
req = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=body,
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
)
with urllib.request.urlopen(req, timeout=30) as resp:
    answer = json.load(resp)["choices"][0]["message"]
print("the model said:", answer.get("content"), file=sys.stderr)
print("not json")
