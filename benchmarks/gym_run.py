"""Claim (issue 16): ``configs/gym.toml`` runs 100+ reasoning-gym domains at once on the 2-core
machine: every trained domain gets trained groups, the configured shares are met, nothing is
dead-lettered, and (with the real model, 20 minutes) the held-out reward rises on the mix.

Runs ``streamrl up --config configs/gym.toml --fresh --max-minutes M --summary-json S`` (the
real CLI, embedded Redis, every actor a process; a fresh run, never a resumed one) with
``--set`` overrides, then checks its summary:

- ``domains``: the trained domains (``scheduler.domains``) that have at least one trained
  group, out of how many; the eval-only domains (``scheduler.eval_domains``) are left out;
- ``shares``: for each trained domain whose configured share of the admitted groups is at
  least ``--min-expected`` groups, admitted / expected (expected = total admitted x its
  weight / the sum of weights); ``off``: those more than ``--share-tolerance`` away, and the
  domains expecting fewer groups (where 10% is under one group) more than one group away;
- ``dead_letters``: the run's dead letters (none is planted here, so any is a failure);
- ``families``: per reasoning-gym family (the module a data set lives in: arithmetic,
  algorithmic, games, ...), the mean held-out reward of its domains in the first and the last
  completed round, and the mix (every trained domain) the same way.

JSON out (``--json``); exit status 1 when a check fails (``checks`` says which).

    .venv/bin/python benchmarks/gym_run.py --json --minutes 5 --set model.spec=tiny
    .venv/bin/python benchmarks/gym_run.py --json --minutes 20          # the real model
    .venv/bin/python benchmarks/gym_run.py --json --summary runs/gym.json   # check only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_up(config: Path, minutes: float, sets: list[str], summary: Path, log: Path) -> float:
    """``streamrl up`` for ``minutes``; returns its wall time. Its output goes to ``log``."""
    argv = [sys.executable, "-m", "streamrl", "up", "--config", str(config), "--fresh",
            "--max-minutes", str(minutes), "--summary-json", str(summary)]  # fmt: skip
    for s in sets:
        argv += ["--set", s]
    env = dict(os.environ)
    env.pop("STREAMRL_REDIS_URL", None)
    started = time.monotonic()
    with log.open("wb") as out:
        done = subprocess.run(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=minutes * 60 + 900, check=False)  # fmt: skip
    if done.returncode != 0:
        tail = log.read_bytes()[-3000:].decode(errors="replace")
        raise SystemExit(f"streamrl up exited {done.returncode}; its log ends:\n{tail}")
    return time.monotonic() - started


def families(names: list[str], config: dict[str, Any]) -> dict[str, str]:
    """domain -> its reasoning-gym family (the data set's module under reasoning_gym)."""
    from reasoning_gym.factory import DATASETS

    out = {}
    for name in names:
        dataset = config.get("domain", {}).get(name, {}).get("dataset")
        if dataset in DATASETS:
            out[name] = DATASETS[dataset][0].__module__.split(".")[1]
    return out


def first_last(series: list[float | None]) -> tuple[float | None, float | None]:
    done = [x for x in series if x is not None]
    return (done[0], done[-1]) if done else (None, None)


def check(summary: dict[str, Any], config: dict[str, Any], args: argparse.Namespace) -> dict:
    sched = config.get("scheduler", {})
    trained_names = list(sched.get("domains", []))
    rows = summary.get("domains", {})
    with_groups = [d for d in trained_names if rows.get(d, {}).get("trained", 0) > 0]
    weights = {d: float(config.get("domain", {}).get(d, {}).get("weight", 1.0))
               for d in trained_names}  # fmt: skip
    total = sum(rows.get(d, {}).get("admitted", 0) for d in trained_names)
    shares, deviation = {}, {}
    for d in trained_names:
        expected = total * weights[d] / sum(weights.values())
        admitted = rows.get(d, {}).get("admitted", 0)
        deviation[d] = admitted - expected
        if expected >= args.min_expected:
            shares[d] = admitted / expected
    off = {d: round(r, 3) for d, r in shares.items() if abs(r - 1) > args.share_tolerance}
    # where a domain expects fewer groups, 10% is below one group: allow one
    off.update({d: round(x, 2) for d, x in deviation.items() if d not in shares and abs(x) > 1})

    fam = families(trained_names, config)
    by_family: dict[str, dict[str, list[float]]] = {}
    for d in trained_names:
        before, after = first_last(rows.get(d, {}).get("eval", []))
        if before is None or after is None:
            continue
        for key in (fam.get(d, "other"), "(mix)"):
            slot = by_family.setdefault(key, {"before": [], "after": []})
            slot["before"].append(before)
            slot["after"].append(after)
    family_rows = {
        f: {"domains": len(v["before"]), "before": round(statistics.fmean(v["before"]), 4),
            "after": round(statistics.fmean(v["after"]), 4)}
        for f, v in sorted(by_family.items())
    }  # fmt: skip
    checks = {
        "domains_at_least_100": len(trained_names) >= 100,
        "every_domain_trained": len(with_groups) == len(trained_names),
        "shares_within_tolerance": not off,
        "no_dead_letters": summary.get("dead_letters", 0) == 0,
    }
    if args.want_rise:
        mix = family_rows.get("(mix)")
        checks["held_out_rises_on_the_mix"] = bool(mix and mix["after"] > mix["before"])
    return {
        "domains": {"trained_domains": len(trained_names), "with_trained_groups":
                    len(with_groups), "without": sorted(set(trained_names) - set(with_groups))},
        "shares": {"admitted_total": total, "checked": len(shares),
                   "ratio_min": round(min(shares.values()), 3) if shares else None,
                   "ratio_max": round(max(shares.values()), 3) if shares else None,
                   "deviation_groups_min": round(min(deviation.values()), 2),
                   "deviation_groups_max": round(max(deviation.values()), 2),
                   "off": off},
        "dead_letters": summary.get("dead_letters", 0),
        "families": family_rows,
        "steps": summary.get("steps"),
        "policy_version": summary.get("policy_version"),
        "eval_rounds": len(summary.get("eval_rounds", [])),
        "eval_reward_before": summary.get("eval_reward_before"),
        "eval_reward_after": summary.get("eval_reward_after"),
        "eval_only": {d: rows.get(d, {}).get("eval") for d in sched.get("eval_domains", [])},
        "checks": checks,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs" / "gym.toml")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--set", dest="sets", action="append", default=[],
                   help="a config override passed on to streamrl up (repeatable)")
    p.add_argument("--summary", type=Path, default=None,
                   help="check this summary JSON instead of running")
    p.add_argument("--out-dir", type=Path, default=REPO / "runs" / "gym_run")
    p.add_argument("--min-expected", type=float, default=10.0,
                   help="check the share of domains expected to get at least this many groups")
    p.add_argument("--share-tolerance", type=float, default=0.10)
    p.add_argument("--want-rise", action="store_true",
                   help="also check that the held-out reward rises on the mix")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    config = tomllib.loads(args.config.read_text())
    result: dict[str, Any] = {"config": str(args.config), "sets": args.sets}
    if args.summary is None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        summary_path = args.out_dir / "summary.json"
        log = args.out_dir / "up.log"
        result["wall_s"] = round(run_up(args.config, args.minutes, args.sets, summary_path,
                                        log), 1)  # fmt: skip
        result["minutes"] = args.minutes
        result["log"] = str(log)
    else:
        summary_path = args.summary
    result["summary"] = str(summary_path)
    result.update(check(json.loads(summary_path.read_text()), config, args))
    result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=2 if args.json else None))
    sys.exit(0 if all(result["checks"].values()) else 1)


if __name__ == "__main__":
    main()
