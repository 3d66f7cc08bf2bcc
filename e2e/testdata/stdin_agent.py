"""An exec agent that reports what it was given: its stdin, raw and parsed,
and the contract's environment variables, in the extra_fields of its last
stdout line."""

import json
import os
import sys

raw = sys.stdin.read()
doc = json.loads(raw)
env = {k: v for k, v in os.environ.items() if k.startswith(("OPENAI_", "OSMOSIS_"))}
messages = doc["prompt"] + [{"role": "assistant", "content": "The answer is 42."}]
print("some log line before the result")
print(json.dumps({"messages": messages, "extra_fields": {"stdin_raw": raw, "stdin": doc, "env": env}}))
