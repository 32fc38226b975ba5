"""LoRA on the real tiny Llama: only the adapters train, the published weights load in the
generator's engine, the KL reference is the base, and a resumed run continues identically."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import PeftModel

from streamrl.actors.learner import open_trainer, train_config
from streamrl.config.schema import load_config
from streamrl.inference.transformers_engine import open_transformers_engine
from streamrl.learner.batch import build_batch
from streamrl.learner.checkpoint import (
    TRAINER_STATE_FILE,
    Snapshot,
    load_trainer_state,
    save_state_dict,
)
from streamrl.learner.lora import ADAPTER_SUBDIR, LoraExport, LoraSettings, find_adapter
from streamrl.learner.train import TrainConfig, Trainer, token_logprobs
from streamrl.learner.weights import WEIGHTS_FILE, save_weights, version_dir
from streamrl.models import load_model
from streamrl.protocol.messages import Trajectory
from streamrl.testing.messages import make_trajectory

IDS = torch.tensor([[1, 510, 2021, 314, 17, 2, 99, 1500]])
LORA = LoraSettings(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))


def _groups(seed: int, n: int = 1) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        comps = [[rng.randrange(3, 2000) for _ in range(rng.randint(2, 6))] for _ in range(4)]
        lps = [[-rng.uniform(1, 8) for _ in c] for c in comps]
        out.append(make_trajectory([1, 2, 3], comps, lps, [1.0, 0.0, 0.5, 0.0], temperature=0.8))
    return out


def _logits(model: Any) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _trained(model: Any, steps: int = 2, **overrides: Any) -> Trainer:
    trainer = Trainer(model, TrainConfig(lr=1e-2, lora=LORA, **overrides))
    for i in range(steps):
        assert not trainer.step(_groups(i)).skipped
    return trainer


def test_a_lora_step_changes_only_the_adapters(tiny_model: Any) -> None:
    # Given the tiny model under LoRA
    base = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    trainer = Trainer(tiny_model, TrainConfig(lr=1e-2, lora=LORA))
    adapters = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    before = {n: p.detach().clone() for n, p in adapters.items()}

    # When it takes two steps
    for i in range(2):
        trainer.step(_groups(i))

    # Then every base tensor is bit-identical (under its peft name: ...base_layer.weight)
    state = trainer.model.state_dict()
    frozen = {k: v for k, v in state.items() if ".lora_" not in k}
    assert len(frozen) == len(base)
    for name, tensor in frozen.items():
        assert torch.equal(tensor, base[name.replace(".base_layer.", ".")]), name
    # and every adapter moved (B from zero, A by its gradient through B)
    assert all(not torch.equal(p, before[n]) for n, p in adapters.items())
    # and AdamW keeps state for the adapters only
    moments = trainer.optimizer.state_dict()["state"]
    assert len(moments) == len(adapters)
    kept = sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in moments.values())
    assert kept == 2 * sum(p.numel() for p in adapters.values())


def test_published_merged_weights_load_in_the_engine(tiny_dir: Path, tmp_path: Path) -> None:
    # Given a trained LoRA policy and peft's own merge of it as the expected model
    trainer = _trained(load_model(tiny_dir))
    expected = _logits(copy.deepcopy(trainer.peft).merge_and_unload())
    assert not torch.equal(expected, _logits(load_model(tiny_dir)))

    # When the merged version is published (as the learner actor writes it)
    path = save_weights(LoraExport(trainer.peft, "merged"), tiny_dir, tmp_path, 1, keep_last=2)

    # Then it is a plain HF directory (the adapter out of the engines' glob, in adapter/)
    assert sorted(p.name for p in path.glob("*.safetensors")) == [WEIGHTS_FILE]
    assert find_adapter(path) == path / ADAPTER_SUBDIR
    # that loads without peft and gives the merged model's logits
    assert torch.equal(_logits(load_model(path)), expected)


async def test_the_engine_serves_the_merged_weights(tiny_dir: Path, tmp_path: Path) -> None:
    # Given a published merged version and the generator's in-process engine on the base
    trainer = _trained(load_model(tiny_dir))
    expected = _logits(copy.deepcopy(trainer.peft).merge_and_unload())
    path = save_weights(LoraExport(trainer.peft, "merged"), tiny_dir, tmp_path, 1, keep_last=2)
    async with open_transformers_engine(tiny_dir, max_batch=2) as engine:
        # When the engine loads it as it loads every version (between batches)
        await engine.update_weights(path, 1)
        # Then it serves that version with the merged model's logits
        assert engine.weight_version == 1
        assert torch.allclose(_logits(engine.model), expected, atol=1e-6)


def test_adapter_publishing_is_a_peft_adapter(tiny_dir: Path, tmp_path: Path) -> None:
    trainer = _trained(load_model(tiny_dir))
    expected = _logits(trainer.peft)

    path = save_weights(LoraExport(trainer.peft, "adapter"), tiny_dir, tmp_path, 1, keep_last=2)

    # the adapter alone (what SGLang's /load_lora_adapter reads), no full weights
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in path.iterdir()}
    assert not (path / WEIGHTS_FILE).exists() and find_adapter(path) == path
    # and peft puts it on the base: the trained policy again
    loaded = PeftModel.from_pretrained(load_model(tiny_dir), path)
    assert torch.allclose(_logits(loaded), expected, atol=1e-6)


def test_kl_reference_under_lora_is_the_base(tiny_dir: Path) -> None:
    # Given a LoRA trainer with a KL penalty, built the way the learner actor builds it
    config = TrainConfig(lr=1e-2, lora=LORA, kl_coef=0.5)
    trainer = Trainer.from_dir(tiny_dir, config, ref_dir=tiny_dir)
    # Then no reference model is loaded (no second copy of the weights)
    assert trainer.ref_model is None
    with pytest.raises(ValueError, match="adapters"):
        Trainer(load_model(tiny_dir), config, ref_model=load_model(tiny_dir))

    # When the adapters have moved away from zero
    first = trainer.step(_groups(0))
    assert first.kl_ref == pytest.approx(0.0, abs=1e-9)  # B = 0: the policy is the base
    trainer.step(_groups(1))
    later = trainer.step(_groups(2))
    assert later.kl_ref > 0

    # Then the reference logprobs are the base model's, not the policy's
    batch = build_batch(_groups(3), pad_id=trainer.pad_id)
    base = token_logprobs(load_model(tiny_dir).eval(), batch)
    trainer.model.eval()
    assert torch.allclose(trainer.base_logprobs(batch), base, atol=1e-6)
    with torch.no_grad():
        policy = token_logprobs(trainer.model, batch)
    assert not torch.allclose(policy, base, atol=1e-4)


def _config(tiny_dir: Path, run_dir: Path) -> Any:
    return load_config(None, [
        f'model.spec="{tiny_dir}"', f'run.work_dir="{run_dir}"', "run.seed=5",
        "learner.lr=1e-2", "learner.micro_batch_size=2", "learner.threads=0",
        "learner.lora.enabled=true", "learner.lora.rank=4", "learner.lora.dropout=0.2",
        'learner.lora.target_modules=["q_proj", "v_proj", "down_proj"]',
    ])  # fmt: skip


def _fresh_process_rngs() -> None:
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)


def test_resume_from_a_lora_checkpoint_continues_identically(
    tiny_dir: Path, tmp_path: Path
) -> None:
    config = _config(tiny_dir, tmp_path / "run")
    root = config.run.path / "weights"
    batches = [_groups(i) for i in range(4)]
    assert train_config(config).lora is not None

    # Given a run of 4 steps straight (adapter dropout: the steps draw random numbers)
    straight, _, _ = open_trainer(config)
    for b in batches:
        straight.step(b)

    # When another run stops after 2 with the checkpoint the learner actor writes
    # (snapshot of the policy, merged weights + adapter/, trainer state)
    first, version, resumed_opt = open_trainer(config)
    assert (version, resumed_opt) == (0, False)
    for b in batches[:2]:
        first.step(b)
    snapshot = Snapshot(first.policy)
    state = snapshot.take(first.policy, first.optimizer, first.steps, first.state_dict()["rng"])
    assert state is not None
    save_weights(LoraExport(snapshot.model, "merged"), tiny_dir, root, 2, keep_last=2,
                 extra=lambda d: save_state_dict(state, d))  # fmt: skip
    # the trainer state holds the adapters' moments only: far below the weights
    written = version_dir(root, 2)
    state_bytes = (written / TRAINER_STATE_FILE).stat().st_size
    assert state_bytes < (written / WEIGHTS_FILE).stat().st_size / 4
    # and resumes in a fresh trainer (the base, then the adapter of v000002)
    _fresh_process_rngs()
    resumed, version, resumed_opt = open_trainer(config)
    assert (version, resumed_opt) == (2, True)
    loaded = load_trainer_state(written)
    assert loaded is not None and loaded["steps"] == resumed.steps == 2
    for b in batches[2:]:
        resumed.step(b)

    # Then adapters, base and AdamW moments are identical, bit for bit
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][m], sb[i][m]) for i in sa for m in ("exp_avg", "exp_avg_sq"))


def test_an_adapter_of_another_rank_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    trainer = _trained(load_model(tiny_dir), steps=1)
    path = save_weights(LoraExport(trainer.peft, "merged"), tiny_dir, tmp_path, 1, keep_last=2)
    other = Trainer(load_model(tiny_dir), TrainConfig(lora=LoraSettings(
        rank=8, target_modules=LORA.target_modules)))  # fmt: skip
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ValueError, match="shape"):
        other.load_adapter(path)
    assert all(torch.equal(v, before[k]) for k, v in other.model.state_dict().items())
    with pytest.raises(FileNotFoundError):
        other.load_adapter(tiny_dir)  # a full-weights directory has no adapter


def test_settings_that_cannot_run_are_refused_at_start() -> None:
    # no generator loads an adapter yet: the pipeline publishes merged weights
    with pytest.raises(ValueError, match="load_lora_adapter"):
        load_config(None, ["learner.lora.enabled=true", 'learner.lora.publish="adapter"'])
    assert load_config(None, ['learner.lora.publish="adapter"']).learner.lora.enabled is False
    with pytest.raises(ValueError, match="lora with parallelism ddp"):
        TrainConfig(lora=LORA, parallelism="fsdp")
    with pytest.raises(ValueError, match="rank >= 1"):
        LoraSettings(rank=0)
