"""An exec agent that floods stdout (FLOOD_MIB MiB of lines, 64 by default)
before its real last line, {"messages": [...]}.

It records its parent's pid (the rollout server's) under
$E2E_PID_DIR/$OSMOSIS_ROLLOUT_ID, then waits for a file of that name plus
".go" before flooding, so the test can read the server's memory use first.
"""

import json
import os
import sys
import time

task = json.load(sys.stdin)
path = os.path.join(os.environ["E2E_PID_DIR"], os.environ["OSMOSIS_ROLLOUT_ID"])
with open(path + ".tmp", "w") as f:
    f.write(str(os.getppid()))
os.rename(path + ".tmp", path)
while not os.path.exists(path + ".go"):
    time.sleep(0.01)

out = sys.stdout.buffer
line = b"flood " + b"x" * 1017 + b"\n"  # 1 KiB a line
for _ in range(int(os.environ.get("FLOOD_MIB", "64")) * 1024):
    out.write(line)
messages = task["prompt"] + [{"role": "assistant", "content": "6 times 7 is 42."}]
out.write(json.dumps({"messages": messages}).encode() + b"\n")
out.flush()
