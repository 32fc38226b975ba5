"""Claim: a model's oversized tool call is refused at once, for its size, before its JSON is
read or checked against the tool's schema (inference/chat.py ``parse_tool_calls``,
``max_call_chars``: 256 KiB by default), so a 10 MB call costs about a scan of the reply
rather than a parse and a validation of 10 MB; and a wrongly typed 100 KB argument is
refused with a short message that does not echo it.

Rows, each the median of ``--repeats`` runs in this process:
- ``refused``: a ``read_file`` call of ``--mb`` MB parsed with the default limit (refused);
- ``parsed`` (the baseline): the same call parsed with a limit above its size, so it is read
  and validated as any call is (what the refusal saves);
- ``wrong_type``: a call whose ``path`` is a list of one 100 KB string (parsed, refused by
  the schema; the message stays short).

Figures: seconds per call, ``refused_speedup`` = parsed / refused, and each row's message
length. (tests/inference/test_chat_tools.py keeps the behaviour: refused, short messages.)

    .venv/bin/python benchmarks/tool_call_refusal.py --json [--mb 10] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from streamrl.inference.chat import ParsedReply, Tool, parse_tool_calls

READ = Tool(name="read_file", description="Read a file of the work dir.", parameters={
    "type": "object", "properties": {"path": {"type": "string"}},
    "required": ["path"], "additionalProperties": False})


def _call(path: Any) -> str:
    return "<tool_call>" + json.dumps({"name": "read_file", "arguments": {"path": path}}) \
        + "</tool_call>"


def _timed(parse: Callable[[], ParsedReply], repeats: int) -> dict[str, Any]:
    times, reply = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        reply = parse()
        times.append(time.perf_counter() - started)
    assert reply is not None and len(reply.calls) == 1
    [call] = reply.calls
    return {"seconds": round(statistics.median(times), 6), "error": call.error[:80],
            "error_chars": len(call.error)}


def run(mb: float, repeats: int) -> dict[str, Any]:
    big = _call("x" * int(mb * 1_000_000))
    wrong = _call(["y" * 100_000])
    refused = _timed(lambda: parse_tool_calls(big, [READ]), repeats)
    parsed = _timed(lambda: parse_tool_calls(big, [READ], max_call_chars=len(big) * 2), repeats)
    wrong_type = _timed(lambda: parse_tool_calls(wrong, [READ]), repeats)
    assert refused["error"].startswith("call too large"), refused
    assert parsed["error"] == "", parsed  # the baseline reads and accepts the call
    return {
        "claim": "an oversized tool call is refused for its size, before its JSON is read",
        "call_mb": mb, "repeats": repeats, "python": platform.python_version(),
        "refused": refused, "parsed": parsed, "wrong_type": wrong_type,
        "refused_speedup": round(parsed["seconds"] / max(refused["seconds"], 1e-9), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=10.0, help="size of the oversized call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    result = run(args.mb, args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        for row in ("refused", "parsed", "wrong_type"):
            r = result[row]
            print(f"{row:>10}: {r['seconds'] * 1000:9.2f} ms  {r['error'] or 'accepted'}")
        print(f"refused {result['refused_speedup']}x faster than parsed")


if __name__ == "__main__":
    main()
