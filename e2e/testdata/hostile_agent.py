"""An exec agent that misbehaves as its prompt says (e2e containment tests).

It first reports, on stderr, its scratch directory (its TMPDIR and its
working directory) and cgroups, so the test can check both are gone after
the run. Prompts:

  benign       answers 42 and exits 0
  fork         forks without end, ignoring failures
  memory       allocates 8 GiB and touches it
  write PATH   writes PATH (outside its directory), then says it did
  env          prints its whole environment on stdout and stderr
"""
import json
import os
import sys

doc = json.load(sys.stdin)
prompt = doc["prompt"][-1]["content"]
with open("/proc/self/cgroup") as f:
    cgroups = ";".join(line.strip() for line in f)
print("HOSTILE-SCRATCH=%s HOSTILE-CWD=%s HOSTILE-CGROUPS=%s" % (os.environ.get("TMPDIR", ""), os.getcwd(), cgroups), file=sys.stderr, flush=True)


def answer(text):
    print(json.dumps({"messages": doc["prompt"] + [{"role": "assistant", "content": text}]}))


if prompt == "benign":
    answer("42")
elif prompt == "fork":
    while True:
        try:
            os.fork()
        except OSError:
            pass
elif prompt == "memory":
    block = bytearray(8 << 30)
    answer("allocated %d" % len(block))
elif prompt.startswith("write "):
    path = prompt[len("write "):]
    with open(path, "w") as f:
        f.write("escaped")
    answer("wrote " + path)
elif prompt == "env":
    env = "\n".join("%s=%s" % kv for kv in sorted(os.environ.items()))
    print(env, file=sys.stderr)
    answer(env)
else:
    sys.exit("unknown prompt " + prompt)
