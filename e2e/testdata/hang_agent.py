"""An exec agent that starts a grandchild, records both pids, then makes an
LLM call the policy never answers: what a cancelled rollout must clean up."""

import json
import os
import subprocess
import sys
import urllib.request

task = json.load(sys.stdin)
child = subprocess.Popen(["sleep", "300"])
path = os.path.join(os.environ["E2E_PID_DIR"], os.environ["OSMOSIS_ROLLOUT_ID"])
with open(path + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(path + ".tmp", path)
body = json.dumps({"model": "openai/osmosis-rollout", "messages": task["prompt"]}).encode()
req = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=body,
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
)
urllib.request.urlopen(req, timeout=600).read()
