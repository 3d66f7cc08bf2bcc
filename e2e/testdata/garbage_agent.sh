#!/bin/sh
# An exec agent that exits 0 having made no LLM call and printed nothing a
# sample could be read from: there is no conversation to grade.
cat >/dev/null
echo "this is not JSON"
echo "{not json either"
echo "[1, 2, 3]"
