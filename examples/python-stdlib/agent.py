#!/usr/bin/env python3
"""A tool-calling agent in the Python standard library, run by `osmo serve --exec`.

It shows that the exec contract needs no SDK: the runner starts one process
per sample with

  env    OPENAI_BASE_URL (= OSMOSIS_CHAT_COMPLETIONS_URL), the LLM proxy bound
         to this rollout and sample; OPENAI_API_KEY, a per-rollout token;
         OSMOSIS_ROLLOUT_ID and OSMOSIS_SAMPLE_ID;
  stdin  {"prompt": [chat messages], "metadata": {...}, "config": {...}};

and takes the last stdout line, {"messages": [...]}, as the sample's
messages (here plain OpenAI chat messages). Logs go to stderr; any failure
exits non-zero.

    osmo serve --exec "python3 examples/python-stdlib/agent.py"
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any, Callable

PLACEHOLDER_MODEL = "openai/osmosis-rollout"
SYSTEM_PROMPT = "You are a calculator. Use the add and multiply tools for arithmetic."

# Bounds on one run, overridable from the sample's config.
DEFAULT_MAX_TURNS = 10
DEFAULT_TIMEOUT_SECONDS = 300.0
MAX_RESPONSE_BYTES = 64 << 20


class AgentError(Exception):
    """A failure the agent reports on stderr before exiting with status 1."""


def _number_tool(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    }


TOOLS = [
    _number_tool("add", "Add two numbers."),
    _number_tool("multiply", "Multiply two numbers."),
]

OPERATIONS: dict[str, Callable[[float, float], float]] = {
    "add": lambda a, b: a + b,
    "multiply": lambda a, b: a * b,
}


def run_tool(name: str, arguments: str) -> str:
    """Runs one tool call; mistakes go back to the model as the result text."""
    op = OPERATIONS.get(name)
    if op is None:
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments or "{}")
        a, b = args["a"], args["b"]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
            raise TypeError("a and b must be numbers")
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: bad arguments for {name}: {exc}"
    v = op(a, b)
    return str(int(v)) if float(v).is_integer() else repr(v)


def chat_completion(base_url: str, api_key: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POSTs one chat completion and returns the decoded answer."""
    req = urllib.request.Request(
        base_url.rstrip("/") + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        detail = exc.read(4096).decode("utf-8", "replace")
        raise AgentError(f"chat completion: HTTP {exc.code}: {detail}") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise AgentError(f"chat completion: {exc}") from exc
    if len(raw) > MAX_RESPONSE_BYTES:
        raise AgentError(f"chat completion: response exceeds {MAX_RESPONSE_BYTES} bytes")
    try:
        out = json.loads(raw)
        message = out["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise AgentError(f"chat completion: malformed response: {raw[:200]!r}") from exc
    if not isinstance(message, dict):
        raise AgentError("chat completion: choices[0].message is not an object")
    return out


def read_input(stream) -> dict[str, Any]:
    """Reads and checks the sample document from stdin."""
    try:
        doc = json.load(stream)
    except ValueError as exc:
        raise AgentError(f"stdin: not a JSON object: {exc}") from exc
    if not isinstance(doc, dict):
        raise AgentError("stdin: not a JSON object")
    prompt = doc.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise AgentError('stdin: "prompt" must be a non-empty array of chat messages')
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise AgentError(f'stdin: "prompt[{i}].role" must be a string')
    for key in ("metadata", "config"):
        if doc.get(key) is None:  # absent or null: none given
            doc[key] = {}
        elif not isinstance(doc[key], dict):
            raise AgentError(f'stdin: "{key}" must be an object')
    return doc


def config_number(config: dict[str, Any], key: str, default: float) -> float:
    v = config.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise AgentError(f'stdin: "config.{key}" must be a number')
    return v


def run(doc: dict[str, Any], base_url: str, api_key: str) -> list[dict[str, Any]]:
    """Plays the conversation to a final answer and returns its messages."""
    config = doc.get("config") or {}
    max_turns = int(config_number(config, "max_turns", DEFAULT_MAX_TURNS))
    timeout = float(config_number(config, "timeout_seconds", DEFAULT_TIMEOUT_SECONDS))
    messages: list[dict[str, Any]] = list(doc["prompt"])
    if not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    body: dict[str, Any] = {"model": PLACEHOLDER_MODEL, "tools": TOOLS}
    for key in ("temperature", "max_tokens"):
        if key in config:
            body[key] = config_number(config, key, 0)
    for _ in range(max_turns):
        out = chat_completion(base_url, api_key, {**body, "messages": messages}, timeout)
        message = out["choices"][0]["message"]
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            return messages
        for call in calls:
            fn = call.get("function") or {}
            result = run_tool(fn.get("name", ""), fn.get("arguments", ""))
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
    raise AgentError(f"no final answer after {max_turns} turns")


def main() -> int:
    try:
        base_url = os.environ.get("OPENAI_BASE_URL") or os.environ.get("OSMOSIS_CHAT_COMPLETIONS_URL")
        if not base_url:
            raise AgentError("environment variable OPENAI_BASE_URL (or OSMOSIS_CHAT_COMPLETIONS_URL) is not set")
        api_key = os.environ.get("OPENAI_API_KEY")
        if not api_key:
            raise AgentError("environment variable OPENAI_API_KEY is not set")
        messages = run(read_input(sys.stdin), base_url, api_key)
    except AgentError as exc:
        print(f"python-stdlib agent: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"messages": messages}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
