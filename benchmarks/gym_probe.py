"""Claim (measured, not hoped): what a model scores on configs/gym.toml's held-out items before
any training, i.e. whether a GRPO group of its samples can carry a signal at all (a group
whose rewards are all equal has zero advantage and teaches nothing).

It samples ``--domains`` reasoning-gym domains of configs/gym.toml (seeded), takes the first
held-out item of each, renders it as the run does (the domain's prompt; ``--format-prompt``
replaces the system prompt with a terse one asking for ``<answer>`` tags plus one worked
example), decodes ``--samples`` completions per item with the in-process engine's decoder
(temperature ``--temperature``, ``max_new_tokens`` as gym.toml), and scores each with the
domain's own ``score_answer``. Reports the mean reward, the share of completions with an
``<answer>`` tag, and the items with any nonzero reward. JSON out.

    .venv/bin/python benchmarks/gym_probe.py --json                      # SmolLM2-135M
    .venv/bin/python benchmarks/gym_probe.py --json --format-prompt --domains 32
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import statistics
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
FORMAT_PROMPT = {
    "system": "Solve the problem. Give only the final answer, inside <answer></answer> tags.",
    "few_shot": [{"prompt": "What is 7 + 5?", "answer": "<answer>12</answer>"}],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "gym.toml")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--domains", type=int, default=24)
    ap.add_argument("--samples", type=int, default=1, help="completions per item")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--format-prompt", action="store_true")
    ap.add_argument("--datasets", default="",
                    help="comma-separated domains of the config instead of a seeded sample")
    ap.add_argument("--items", type=int, default=1, help="held-out items per domain")
    ap.add_argument("--set-prompt", default="",
                    help="a JSON [domain.<name>.prompt] table applied to every picked domain")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import msgspec
    import torch

    from streamrl.config.schema import DomainConfig
    from streamrl.domains.gym import ReasoningGymDomain
    from streamrl.domains.template import with_prefix
    from streamrl.inference.decode import Row, decode_batch
    from streamrl.models import load_model, load_tokenizer, resolve_model

    torch.set_num_threads(args.threads)
    cfg = tomllib.loads(args.config.read_text())
    max_new = int(cfg["scheduler"].get("max_new_tokens", 96))
    names = sorted(n for n, d in cfg["domain"].items() if d.get("kind") == "reasoning_gym")
    if args.datasets:
        picked = [n for n in args.datasets.split(",") if n]
    else:
        picked = random.Random(args.seed).sample(names, min(args.domains, len(names)))
    path = resolve_model(args.model)
    tokenizer, model = load_tokenizer(path), load_model(path).eval()
    items = []
    for name in picked:
        table = dict(cfg["domain"][name])
        if args.format_prompt:
            table["prompt"] = FORMAT_PROMPT
        if args.set_prompt:
            table["prompt"] = {**table.get("prompt", {}), **json.loads(args.set_prompt)}
        with contextlib.redirect_stdout(io.StringIO()):  # some generators print
            domain = ReasoningGymDomain(name, msgspec.convert(table, DomainConfig))
            for item in domain.load_items("eval")[:args.items]:
                items.append((name, domain, item, domain.render_prompt(item, tokenizer)))
    rows = [Row(prompt=p, max_new_tokens=max_new, temperature=args.temperature,
                generator=torch.Generator().manual_seed(1000 * i + s))
            for i, (_, _, _, p) in enumerate(items) for s in range(args.samples)]
    stops = frozenset(t for t in (tokenizer.eos_token_id,
                                  tokenizer.convert_tokens_to_ids("<|im_end|>")) if t is not None)
    start = time.perf_counter()
    results, _ = decode_batch(model, rows, stops, tokenizer.pad_token_id or 0)
    seconds = time.perf_counter() - start
    rewards, tagged, per_domain = [], 0, {}
    groups_with_signal = 0
    for i, (name, domain, item, _) in enumerate(items):
        got = []
        for r in results[i * args.samples:(i + 1) * args.samples]:
            text = tokenizer.decode(r.tokens, skip_special_tokens=True)
            got.append(float(domain.score(item, text, None)))
            tagged += "</answer>" in with_prefix(domain.cfg.prompt, text)
        rewards.extend(got)
        groups_with_signal += len(set(got)) > 1
        per_domain.setdefault(name, []).extend(got)
    per_domain = {k: round(statistics.mean(v), 4) for k, v in per_domain.items()}
    out: dict[str, Any] = {
        "benchmark": "gym_probe", "model": args.model, "format_prompt": args.format_prompt,
        "domains": len(picked), "completions": len(rows), "temperature": args.temperature,
        "max_new_tokens": max_new, "mean_reward": round(statistics.mean(rewards), 4),
        "answer_tag_share": round(tagged / len(rows), 3),
        "items": len(items), "items_with_reward_variance": groups_with_signal,
        "domains_with_reward": sum(v > 0 for v in per_domain.values()),
        "nonzero": {k: v for k, v in per_domain.items() if v > 0},
        "decode_seconds": round(seconds, 1),
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
