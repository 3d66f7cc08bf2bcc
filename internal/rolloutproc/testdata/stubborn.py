"""Never answers /health, ignores SIGTERM, and leaves a child in its group
(its pid written to $ROLLOUTPROC_CHILD_PID_FILE)."""
import os, signal, subprocess, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "1000"])
with open(os.environ["ROLLOUTPROC_CHILD_PID_FILE"], "w") as f:
    f.write(str(child.pid))
print("never healthy", flush=True)
while True:
    time.sleep(1)
