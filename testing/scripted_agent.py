"""A scripted agent for tests and for trying the agent path: written against the official
``openai`` client, as any external agent is, and run by the executor with the episode's
``OPENAI_BASE_URL`` / ``OPENAI_MODEL`` / ``STREAMRL_TOOLS_URL`` in its environment.

``python -m streamrl.testing.scripted_agent [--patch FILE] [--calls N] [--bad-requests]``:
asks the model ``N`` times (the conversation growing each time: its reply as it came, then
what the tools said, as the next user message), lists the work dir and reads the first Python
file through the tools, applies ``FILE`` (a unified diff: the fix it "knows") when given, runs
the tests and calls ``finish``. Without ``--patch`` it does the same and changes nothing. With
``--bad-requests`` it first sends the endpoint the malformed requests of
:data:`BAD_REQUESTS` as raw HTTP (each must be refused with a 4xx OpenAI error, or it exits
1). Prints one JSON line: the calls it made and each tool's answer."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from openai import OpenAI


def tool(name: str, **arguments: Any) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{os.environ['STREAMRL_TOOLS_URL']}/{name}", data=json.dumps(arguments).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


BAD_REQUESTS = {  # a client's mistakes: the session must stay usable after each
    "nested": b'{"model": "%s", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "stream_options": b'{"messages": [{"role": "user", "content": "x"}], "stream": true, '
                      b'"stream_options": "yes", "model": "%s"}',
    "lone_surrogate": b'{"messages": [{"role": "user", "content": "a\\ud800"}], "model": "%s"}',
    "empty": b"",
}


def send_bad_requests(base_url: str, model: str) -> dict[str, int]:
    """Each of :data:`BAD_REQUESTS` to the chat endpoint: ``{name: status}``; raises if one is
    not a 4xx with an OpenAI error body."""
    statuses = {}
    for name, body in BAD_REQUESTS.items():
        request = urllib.request.Request(
            f"{base_url.rstrip('/')}/chat/completions", method="POST",
            data=body.replace(b"%s", model.encode()),
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                raise RuntimeError(f"{name}: answered {response.status}, not a 4xx")
        except urllib.error.HTTPError as error:
            answer = json.loads(error.read())
            if not 400 <= error.code < 500 or not answer["error"]["message"]:
                raise RuntimeError(f"{name}: {error.code} {answer}") from None
            statuses[name] = error.code
    return statuses


def tool_specs() -> list[dict[str, Any]]:
    with urllib.request.urlopen(os.environ["STREAMRL_TOOLS_URL"], timeout=30) as response:
        return json.loads(response.read())["data"]  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--patch", help="a unified diff to apply (none: change nothing)")
    ap.add_argument("--calls", type=int, default=2, help="model calls")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--bad-requests", action="store_true",
                    help="first send the endpoint malformed requests (each must be a 4xx)")
    args = ap.parse_args(argv)

    client = OpenAI()  # OPENAI_BASE_URL, OPENAI_API_KEY
    model = os.environ["OPENAI_MODEL"]
    refused = send_bad_requests(str(client.base_url), model) if args.bad_requests else {}
    tools: Any = tool_specs()  # OpenAI function specs, as the endpoint lists them
    messages: list[Any] = [{"role": "user", "content": "Fix the failing test of this repository."}]
    answers: list[dict[str, Any]] = []
    said = ""
    for k in range(args.calls):
        if k:
            messages.append({"role": "user", "content": said})
        reply = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                               max_tokens=args.max_tokens, temperature=1.0)
        messages.append(reply.choices[0].message)  # the reply goes back as it came
        if k == 0:  # the scripted work; what the tools said is the next user turn
            answers.append(tool("list_files"))
            files = [line.split(" ")[0] for line in answers[0]["content"].splitlines()]
            answers.append(tool("read_file", path=next(f for f in files if f.endswith(".py"))))
            if args.patch:
                with open(args.patch) as f:
                    answers.append(tool("apply_patch", patch=f.read()))
            answers.append(tool("run_tests"))
            said = "\n\n".join(a["content"][:500] for a in answers)
        else:
            said = "Go on."
    answers.append(tool("finish", summary="done"))
    print(json.dumps({"calls": args.calls, "answers": answers, "refused": refused}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
