"""The in-process engine holding the policy in bfloat16 (``generator.dtype``): its weights,
its logprobs, fp32 weight updates, and how ``auto`` chooses."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from streamrl.config.schema import GeneratorConfig
from streamrl.inference import transformers_engine as te
from streamrl.inference.transformers_engine import open_transformers_engine, serving_dtype
from streamrl.models import load_model, resolve_model
from streamrl.protocol.messages import Sampling
from tests.inference.test_transformers_engine import PROMPTS, perturbed, teacher_forced


@pytest.fixture
def tiny() -> Path:
    return resolve_model("tiny")


async def test_a_bf16_engine_runs_in_bf16_and_reports_its_own_logprobs(tiny: Path) -> None:
    # Given an engine holding the tiny model in bfloat16
    async with open_transformers_engine(tiny, dtype="bfloat16") as engine:
        assert engine.dtype == torch.bfloat16
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
        # When it samples
        completions = await engine.generate(
            PROMPTS, Sampling(max_new_tokens=12, temperature=0.7, seed=5))
    # Then each token's logprob is the one its own (bf16) weights give that token, in fp32,
    # up to bf16's rounding between a cached decode and one forward pass
    fp32 = load_model(tiny).eval()
    for prompt, c in zip(PROMPTS, completions, strict=True):
        assert c.logprobs.dtype.name == "float32" and len(c.tokens) == 12
        own = teacher_forced(engine.model, prompt, c, 0.7)
        torch.testing.assert_close(torch.from_numpy(c.logprobs), own, atol=0.05, rtol=0)
        # and the float32 learner's logprobs of the same tokens are near them, not equal:
        # the mismatch that the learner's importance weights correct
        learner = teacher_forced(fp32, prompt, c, 0.7)
        gap = (learner - torch.from_numpy(c.logprobs)).abs()
        assert gap.max() < 0.2 and gap.max() > 0


async def test_fp32_weight_updates_are_cast_into_a_bf16_engine(tiny: Path,
                                                               tmp_path: Path) -> None:
    # Given a bf16 engine and new fp32 weights on disk (what the learner publishes)
    new = perturbed(tiny, tmp_path)
    async with open_transformers_engine(tiny, dtype="bfloat16") as engine:
        # When the update is loaded
        await engine.update_weights(tmp_path, 3)
        # Then the engine holds them rounded to bf16, and still computes in bf16
        assert engine.weight_version == 3
        held = engine.model.state_dict()
        for name, value in new.state_dict().items():
            assert held[name].dtype == torch.bfloat16
            assert torch.equal(held[name], value.to(torch.bfloat16)), name
        [c] = await engine.generate([PROMPTS[0]], Sampling(max_new_tokens=4, temperature=0.0))
        assert c.weight_version == 3


def test_auto_is_bf16_only_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert serving_dtype("float32") == torch.float32
    assert serving_dtype("bfloat16") == torch.bfloat16
    assert serving_dtype("auto") == (torch.bfloat16 if te.native_bf16() else torch.float32)
    for amx, avx512_bf16, expected in [(False, False, torch.float32),
                                       (True, False, torch.bfloat16),
                                       (False, True, torch.bfloat16)]:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert serving_dtype("auto") == expected
    with pytest.raises(ValueError, match="float16"):
        serving_dtype("float16")


def test_generator_dtype_is_checked_in_the_config() -> None:
    assert GeneratorConfig().dtype == "float32"
    assert GeneratorConfig(dtype="auto").dtype == "auto"
    with pytest.raises((ValueError, msgspec.ValidationError), match=r"generator\.dtype"):
        GeneratorConfig(dtype="half")
