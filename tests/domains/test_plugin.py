"""The plugin interface: entry-point registry, task files (JSONL / parquet), episode policy,
sandbox spec overrides, per-domain TOML tables."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.actors.scheduler import domain_sampling, shares
from streamrl.config.schema import ConfigError, load_config
from streamrl.domains.base import EpisodePolicy, SandboxSpec, load_task_file
from streamrl.domains.math import MathItem
from streamrl.domains.registry import ENTRY_POINT_GROUP, available, entry_points, get_domain
from streamrl.sandbox.base import Limits

BUILTINS = {"arith", "math", "finance", "code"}


def test_builtins_are_entry_points_like_any_plugin() -> None:
    eps = entry_points()
    assert set(eps) >= BUILTINS and set(available()) >= BUILTINS
    assert all(eps[n].group == ENTRY_POINT_GROUP for n in BUILTINS)
    for name in BUILTINS:
        domain = get_domain(name)
        assert domain.name == name
        assert isinstance(domain.episode, EpisodePolicy)
        assert isinstance(domain.sandbox, SandboxSpec)
        train, evals = domain.load_items("train"), domain.load_items("eval")
        assert train and evals
        assert not {i.prompt for i in train} & {i.prompt for i in evals}
        spec = msgspec.to_builtins(evals[0])  # items survive the wire
        assert msgspec.convert(spec, domain.item_type) == evals[0]


def test_task_files_jsonl_and_parquet(tmp_path: Path) -> None:
    items = [MathItem(id=f"i{k}", prompt=f"p{k}", answer=str(k), kind="t") for k in range(3)]
    pq.write_table(pa.Table.from_pylist([msgspec.to_builtins(i) for i in items]),
                   tmp_path / "a.parquet")
    assert load_task_file(tmp_path / "a.parquet", MathItem) == items
    (tmp_path / "b.jsonl").write_text('{"id": "x", "prompt": "p", "answer": "1", "kind": "t"}\n'
                                      '{"id": "y", "prompt": 3}\n')
    with pytest.raises(ValueError, match="row 1"):
        load_task_file(tmp_path / "b.jsonl", MathItem)


def test_episode_policy_and_sandbox_overrides() -> None:
    assert EpisodePolicy(multi_turn=True, max_turns=6).max_turns == 6
    with pytest.raises(ValueError):
        EpisodePolicy(multi_turn=False, max_turns=3)
    spec = SandboxSpec(limits=Limits(timeout_s=2.0, memory_mb=256), files={"h.py": b"x"})
    out = spec.with_overrides(timeout_s=7.5, memory_mb=1024)
    assert (out.limits.timeout_s, out.limits.cpu_s, out.limits.memory_mb) == (7.5, 8, 1024)
    assert out.files == spec.files and spec.with_overrides() == spec


def test_domain_tables_in_toml() -> None:
    config = load_config("configs/multi.toml")
    by_name = {s.name: s for s in shares(config)}
    assert set(by_name) == {"arith", "math", "finance", "cad"}  # general: eval only
    assert by_name["arith"].weight == 2.0
    assert domain_sampling(config, "finance", 0.7).max_new_tokens == 64
    with pytest.raises(ConfigError, match=r"not in scheduler\.domains"):
        load_config("configs/multi.toml", ["domain.code.weight=1"])
    with pytest.raises(ConfigError):
        load_config("configs/multi.toml", ["domain.math.weight=0"])
