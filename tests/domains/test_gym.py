"""reasoning-gym data sets as domains (domains/gym.py), the item order and curriculum
policies (actors/scheduling.py EpochOrder, next_level, Climb), and the scheduler's
curriculum hook against a real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from streamrl.actors.scheduler import Scheduler
from streamrl.actors.scheduling import Climb, EpochOrder, next_level, reward_counters
from streamrl.config.schema import DomainConfig
from streamrl.domains.declared import DeclarationError, build_domain, declare_domains
from streamrl.domains.gym import ReasoningGymDomain
from streamrl.domains.kinds import Record
from streamrl.domains.registry import get_domain as scheduler_domain
from streamrl.protocol import names as N
from streamrl.protocol import roles
from streamrl.queues.acl import role_url
from streamrl.queues.client import RedisClient
from streamrl.runtime.context import ActorContext
from tests.helpers import role_credentials, run_config


def _gym(dataset: str, **kw: Any) -> ReasoningGymDomain:
    cfg = msgspec.convert({"kind": "reasoning_gym", "dataset": dataset, **kw}, DomainConfig)
    domain = build_domain(f"rg-{dataset}", cfg)
    assert isinstance(domain, ReasoningGymDomain)
    return domain


def test_items_are_generated_deterministically_with_separate_train_and_eval_seeds() -> None:
    split = {"train_size": 30, "eval_size": 10}
    a, b = _gym("chain_sum", split=split), _gym("chain_sum", split=split)
    train, held = a.load_items("train"), a.load_items("eval")
    assert [r.prompt for r in train] == [r.prompt for r in b.load_items("train")]
    assert len(held) == 10 and {r.prompt for r in train}.isdisjoint({r.prompt for r in held})
    # another eval seed: other held-out items, the same train items
    c = _gym("chain_sum", split={**split, "eval_seed": 5_000_000})
    assert [r.prompt for r in c.load_items("eval")] != [r.prompt for r in held]
    assert [r.prompt for r in c.load_items("train")] == [r.prompt for r in train]
    # the data set's config table reaches the generator
    two = _gym("chain_sum", split=split, dataset_config={"min_terms": 2, "max_terms": 2})
    assert all(r.prompt.count("+") + r.prompt.count("-") == 1
               for r in two.load_items("eval")), two.load_items("eval")[0].prompt


def test_scored_by_its_own_score_answer_after_the_wire() -> None:
    domain = _gym("basic_arithmetic", split={"train_size": 5, "eval_size": 5})
    verifier = _gym("basic_arithmetic", split={"train_size": 5, "eval_size": 5})  # another process
    for item in domain.load_items("eval"):
        wire = msgspec.convert(msgspec.msgpack.decode(msgspec.msgpack.encode(
            msgspec.to_builtins(item))), Record)
        assert verifier.score(wire, f"Thinking...\n<answer>{item.answer}</answer>", None) == 1.0
        assert verifier.score(wire, f"{item.answer}", None) == 0.0  # not in the asked format
        assert verifier.score(wire, "<answer>banana</answer>", None) == 0.0
        # an item another process generated differently (its question is not this process's:
        # some generators follow the hash seed) is scored as it was asked, by its own answer
        other = msgspec.structs.replace(wire, prompt=wire.prompt + " ", answer="banana")
        assert verifier.score(other, "<answer>banana</answer>", None) == 1.0
        assert verifier.score(other, f"<answer>{item.answer}</answer>", None) == 0.0


def test_curriculum_levels_get_harder_and_unknown_datasets_are_refused() -> None:
    domain = _gym("chain_sum", split={"train_size": 20, "eval_size": 4},
                  curriculum={"threshold": 0.5})
    assert domain.levels() > 2
    easy, hard = domain.level_items(0), domain.level_items(domain.levels() - 1)
    digits = lambda items: sum(sum(c.isdigit() for c in r.prompt) for r in items)  # noqa: E731
    assert digits(hard) > digits(easy)
    assert {r.extra["level"] for r in hard} == {domain.levels() - 1}
    capped = _gym("chain_sum", curriculum={"threshold": 0.5, "max_level": 1})
    assert capped.levels() == 2
    assert _gym("chain_sum").levels() == 1  # no threshold: no curriculum
    with pytest.raises(DeclarationError, match="reasoning_gym has no data set 'nope'"):
        _gym("nope")


def test_epochs_without_replacement() -> None:
    order = EpochOrder(10, seed=3)
    first, second = [order.next() for _ in range(10)], [order.next() for _ in range(10)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert order.epoch == 2
    again = EpochOrder(10, seed=3)
    assert [again.next() for _ in range(10)] == first  # seeded: the same in every process
    seven = EpochOrder(7, seed=1)
    draws = Counter(seven.next() for _ in range(70))
    assert set(draws.values()) == {10}


def test_next_level_moves_up_only_past_the_threshold_with_enough_groups() -> None:
    kw = {"threshold": 0.7, "min_groups": 8}
    assert next_level(0, 5, groups=8, reward_sum=6.0, **kw) == 1  # mean 0.75
    assert next_level(0, 5, groups=8, reward_sum=5.0, **kw) == 0  # mean 0.625
    assert next_level(0, 5, groups=7, reward_sum=7.0, **kw) == 0  # too few groups
    assert next_level(4, 5, groups=80, reward_sum=80.0, **kw) == 4  # the top level
    assert next_level(0, 5, groups=80, reward_sum=80.0, threshold=0.0, min_groups=1) == 0
    # Climb counts only the groups resolved since its last move
    climb = Climb(levels=3, threshold=0.5, min_groups=4)
    assert climb.observe(4, 3.0) and climb.level == 1
    assert not climb.observe(7, 3.0)  # 3 new groups, reward 0
    assert not climb.observe(8, 3.5)  # 4 new groups, mean 0.125
    assert climb.observe(12, 7.0) and climb.level == 2  # 8 new groups, mean 0.5
    assert (climb.base_groups, climb.base_reward) == (12, 7.0)
    assert not climb.observe(100, 100.0)  # the top level


async def test_the_scheduler_moves_a_domain_up_when_its_reward_passes(
    client: RedisClient, redis_url: str, tmp_path: Path
) -> None:
    names = N.Names(f"t{uuid.uuid4().hex[:10]}")
    config = run_config(
        tmp_path, redis_url, names.run,
        "scheduler.domains=['rg-chain', 'arith']",
        "domain.rg-chain.kind='reasoning_gym'", "domain.rg-chain.dataset='chain_sum'",
        "domain.rg-chain.split.train_size=20", "domain.rg-chain.split.eval_size=4",
        "domain.rg-chain.curriculum.threshold=0.6", "domain.rg-chain.curriculum.min_groups=4",
    )
    declare_domains(config.domain)
    scheduler = Scheduler(ActorContext(config, client, names))
    assert list(scheduler.climbs) == ["rg-chain"]
    level0 = {t.prompt for t in (scheduler.sample(0) for _ in range(40))
              if t is not None and t.domain == "rg-chain"}
    groups, reward = reward_counters("rg-chain")
    # When the verifier's counters say 4 groups at mean reward 0.5: no move
    await client.call(client.sync.set, names.counter(groups), 4)
    await client.call(client.sync.set, names.counter(reward), 2000)
    await scheduler.observe_curriculum()
    assert scheduler.climbs["rg-chain"].level == 0
    # ... and 8 groups at 0.75: level 1, whose items the scheduler samples from then on
    await client.call(client.sync.set, names.counter(groups), 8)
    await client.call(client.sync.set, names.counter(reward), 6000)
    scheduler.next_climb_check = 0.0
    await scheduler.observe_curriculum()
    assert scheduler.climbs["rg-chain"].level == 1
    tasks = [t for t in (scheduler.sample(0) for _ in range(40)) if t is not None]
    level1 = [t for t in tasks if t.domain == "rg-chain"]
    assert level1 and all(t.spec["extra"]["level"] == 1 for t in level1)
    domain: Any = scheduler_domain("rg-chain")
    assert {t.prompt for t in level1} <= {r.prompt for r in domain.level_items(1)}
    assert level0 <= {r.prompt for r in domain.level_items(0)}


def test_up_refuses_a_config_reasoning_gym_refuses_at_start() -> None:
    from streamrl.domains.declared import check_declared

    good = msgspec.convert({"kind": "reasoning_gym", "dataset": "chain_sum"}, DomainConfig)
    check_declared({"rg-good": good})  # a sample of items, not all 1000
    bad = msgspec.convert({"kind": "reasoning_gym", "dataset": "chain_sum",
                           "dataset_config": {"min_terms": 5, "max_terms": 2}}, DomainConfig)
    with pytest.raises(DeclarationError, match=r"domain 'rg-bad': reasoning_gym 'chain_sum'"):
        check_declared({"rg-bad": bad})


def test_items_another_process_generated_differently_are_scored_as_asked() -> None:
    # Given items generated by a process with another hash seed (polynomial_multiplication
    # prints sympy expressions in an order that follows it)
    probe = (
        "import msgspec, sys; from tests.domains.test_gym import _gym\n"
        "items = _gym('polynomial_multiplication', split={'train_size': 4, 'eval_size': 4})"
        ".load_items('eval')\n"
        "sys.stdout.write(msgspec.json.encode(items).decode())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=env, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    items = msgspec.json.decode(done.stdout, type=list[Record])
    here = _gym("polynomial_multiplication", split={"train_size": 4, "eval_size": 4})
    # Then this process scores every one of them by its own answer (none is refused, the
    # right answer earns 1, a wrong one 0), whether or not it generates the same question
    for item in items:
        assert here.score(item, f"<answer>{item.answer}</answer>", None) == 1.0
        assert here.score(item, "<answer>y</answer>", None) == 0.0


def test_a_response_prefix_ends_the_prompt_and_is_scored_with_the_completion() -> None:
    from streamrl.models import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("tiny"))
    split = {"train_size": 5, "eval_size": 5}
    plain = _gym("basic_arithmetic", split=split)
    opened = _gym("basic_arithmetic", split=split, prompt={"response_prefix": "<answer>"})
    item = opened.load_items("eval")[0]
    base, ids = plain.render_prompt(item, tok), opened.render_prompt(item, tok)
    assert ids[:len(base)] == base  # the chat template's prompt, the assistant turn opened
    assert tok.decode(ids[len(base):]) == "<answer>"
    # the model writes what follows the prefix: scored as one turn with it
    assert opened.score(item, f"{item.answer}</answer>", None) == 1.0
    assert plain.score(item, f"{item.answer}</answer>", None) == 0.0  # no opening tag
    assert opened.score(item, f"{item.answer}", None) == 0.0  # never closed
    assert opened.score(item, "7</answer> and <answer>banana</answer>", None) == 0.0  # the last


def test_few_shot_items_are_the_data_sets_own_worked_examples_never_trained_or_held_out(
) -> None:
    split = {"train_size": 200, "eval_size": 20}
    domain = _gym("basic_arithmetic", split=split, prompt={"few_shot_items": 2})
    shots = domain.prompt.few_shot
    assert len(shots) == 2 and all(s.answer.startswith("<answer>") and
                                   s.answer.endswith("</answer>") for s in shots)
    candidates = [domain._generator(-2)[i] for i in range(8)]  # 4 x 2, the shortest 2 kept
    by_prompt = {str(e["question"]): e for e in candidates}
    assert all(by_prompt[s.prompt]["answer"] in s.answer for s in shots)
    assert max(len(s.prompt) for s in shots) <= sorted(len(q) for q in by_prompt)[1]
    used = {r.prompt for r in domain.load_items("train")} | {
        r.prompt for r in domain.load_items("eval")}
    assert used.isdisjoint(s.prompt for s in shots)
    assert _gym("basic_arithmetic", split=split, prompt={"few_shot_items": 2}).prompt == \
        domain.prompt  # the same examples in every process
    from streamrl.domains.template import chat_messages

    item = domain.load_items("eval")[0]
    messages = chat_messages(domain.prompt, item, system=domain.system)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user",
                                             "assistant", "user"]


def test_prompt_options_a_domain_would_ignore_are_refused() -> None:
    def table(**kw: Any) -> DomainConfig:
        return msgspec.convert(kw, DomainConfig)

    with pytest.raises(DeclarationError, match="few_shot_items applies to"):
        build_domain("m", table(kind="exact", data="x.jsonl", prompt={"few_shot_items": 1}))
    with pytest.raises(DeclarationError, match="response_prefix applies to"):
        build_domain("arith", table(prompt={"response_prefix": "<answer>"}))  # a plugin


TSUMEGO = {"split": {"train_size": 8, "eval_size": 4, "train_seed": 67},
           "curriculum": {"threshold": 0.6, "min_groups": 4}}
"""reasoning-gym's tsumego fails to generate some items at levels 1-3 ("Failed to generate a
capture problem"); with these seeds: item 1 of level 1, items 3 and 7 of level 2, item 0 of
level 3 (configs/gym.toml's table, train_seed 1, fails at item 0 of level 1)."""
TSUMEGO_FAILED = {1: {1}, 2: {3, 7}, 3: {0}}


def test_an_item_that_fails_to_generate_is_skipped_and_counted() -> None:
    domain = _gym("tsumego", **TSUMEGO)
    assert domain.levels() == 4
    for level, failed in TSUMEGO_FAILED.items():
        items = domain.level_items(level)  # no error: the level is taken without them
        assert {r.extra["index"] for r in items} == set(range(8)) - failed
        why = domain.generation_failures(level)
        assert set(why) == failed
        assert all("Failed to generate a capture problem" in w for w in why.values())
    assert domain.generation_failures(0) == {}


def test_the_start_check_tries_every_level_and_says_what_failed() -> None:
    # When up checks the declaration at start (at every level, items until one generates)
    domain = _gym("tsumego", **TSUMEGO)
    notes = domain.check()
    # Then the level whose first item failed says so (level 3 here, past level 0)
    assert notes == ["domain 'rg-tsumego': level 3: 1 of its first 2 items failed to generate "
                     "(skipped): RuntimeError: Failed to generate a capture problem"], notes
    assert [set(domain.generation_failures(level)) for level in range(4)] == [
        set(), set(), set(), {0}]  # one item tried at each level but the last: cheap


async def test_the_scheduler_takes_a_level_whose_items_partly_fail_to_generate(
    client: RedisClient, redis_url: str, tmp_path: Path
) -> None:
    names = N.Names(f"t{uuid.uuid4().hex[:10]}")
    config = run_config(
        tmp_path, redis_url, names.run, "scheduler.domains=['rg-go']",
        "domain.rg-go.kind='reasoning_gym'", "domain.rg-go.dataset='tsumego'",
        *(f"domain.rg-go.{k}.{f}={v!r}" for k, t in TSUMEGO.items() for f, v in t.items()),
    )
    declare_domains(config.domain)
    scheduler = Scheduler(ActorContext(config, client, names))
    groups, reward = reward_counters("rg-go")
    # When the verifier's counters say 4 groups at mean reward 0.75
    await client.call(client.sync.set, names.counter(groups), 4)
    await client.call(client.sync.set, names.counter(reward), 3000)
    await scheduler.observe_curriculum()
    # Then the domain is at level 1, without the item reasoning-gym could not generate
    assert scheduler.climbs["rg-go"].level == 1
    assert scheduler.climbs["rg-go"].levels == 4  # and the levels above are still there
    tasks = [t for t in (scheduler.sample(0) for _ in range(14)) if t is not None]
    assert {t.spec["extra"]["index"] for t in tasks} == set(range(8)) - TSUMEGO_FAILED[1]
    assert {t.spec["extra"]["level"] for t in tasks} == {1}


async def test_a_domain_held_back_is_shown_by_status_with_why(
    client: RedisClient, redis_url: str, tmp_path: Path
) -> None:
    from streamrl.cli.status import DomainView, render, snapshot

    # Given count_bits, whose level-1 prompts are all longer than its max_prompt_chars
    names = N.Names(f"t{uuid.uuid4().hex[:10]}")
    config = run_config(
        tmp_path, redis_url, names.run, "scheduler.domains=['rg-bits']",
        "domain.rg-bits.kind='reasoning_gym'", "domain.rg-bits.dataset='count_bits'",
        "domain.rg-bits.split.train_size=16", "domain.rg-bits.split.eval_size=4",
        "domain.rg-bits.max_prompt_chars=74",
        "domain.rg-bits.curriculum.threshold=0.6", "domain.rg-bits.curriculum.min_groups=4",
    )
    declare_domains(config.domain)
    credentials = {"scheduler": role_credentials(names)["scheduler"]}
    await roles.apply_acls(client, names, credentials)  # the scheduler as its own ACL user
    as_user = RedisClient(role_url(client.url.url, credentials["scheduler"]))
    scheduler = Scheduler(ActorContext(config, as_user, names))
    groups, reward = reward_counters("rg-bits")
    # When its reward passes the threshold
    await client.call(client.sync.set, names.counter(groups), 4)
    await client.call(client.sync.set, names.counter(reward), 4000)
    try:
        await scheduler.observe_curriculum()
    finally:
        as_user.close()
        client.sync.execute_command("ACL", "DELUSER", credentials["scheduler"].user)
    # Then it stays at level 0, and status says so and why
    assert scheduler.climbs["rg-bits"].level == 0
    text = render(await snapshot(client, names, view=DomainView(known=("rg-bits",))))
    line = next((x for x in text.splitlines() if x.startswith("held back rg-bits")), "")
    assert "at level 0 of 5" in line and "level 1" in line and "max_prompt_chars" in line, text
