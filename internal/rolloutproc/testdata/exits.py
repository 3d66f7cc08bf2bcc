"""Fails at once, naming the secret on stderr."""
import os, sys
print("starting")
print("boom:", os.environ.get("ROLLOUTPROC_SECRET"), file=sys.stderr)
sys.exit(3)
