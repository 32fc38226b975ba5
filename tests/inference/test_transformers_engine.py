"""TransformersEngine against a real (tiny, randomly initialised) Llama model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from inference.engine import Completion, Engine
from inference.transformers_engine import TransformersEngine, open_transformers_engine
from learner.model import load_model, resolve_model
from queues.messages import Sampling

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356],
    [1, 4093, 198, 6004, 2],
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519],
]


@pytest.fixture
def tiny() -> Path:
    return resolve_model("tiny")


@pytest.fixture
async def engine(tiny: Path) -> AsyncIterator[TransformersEngine]:
    async with open_transformers_engine(tiny) as e:
        yield e


def teacher_forced(model: torch.nn.Module, prompt: list[int], c: Completion,
                   temperature: float) -> torch.Tensor:
    """Logprobs of the completion's tokens from one forward over prompt + completion."""
    ids = torch.tensor([prompt + c.tokens.tolist()])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(1, ids[0, len(prompt):, None])[:, 0]


def assert_consistent(engine: TransformersEngine, prompts: list[list[int]],
                      completions: list[Completion], temperature: float) -> None:
    for p, c in zip(prompts, completions, strict=True):
        assert c.logprobs.dtype.name == "float32" and len(c.logprobs) == len(c.tokens)
        ref = teacher_forced(engine.model, p, c, temperature)
        torch.testing.assert_close(torch.from_numpy(c.logprobs), ref, atol=1e-4, rtol=0)


def test_satisfies_engine_protocol(tiny: Path) -> None:
    def accepts(e: Engine) -> None: ...

    accepts(TransformersEngine(tiny))


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
async def test_logprobs_match_teacher_forcing(engine: TransformersEngine,
                                              temperature: float) -> None:
    # Given prompts of different lengths (left padding in one batch)
    sampling = Sampling(max_new_tokens=12, temperature=temperature, seed=3)
    # When they are generated together
    completions = await engine.generate(PROMPTS, sampling)
    # Then every logprob equals the teacher-forced one at the same temperature
    assert [len(c.tokens) for c in completions] == [12, 12, 12]
    assert all(c.finish_reason == "length" for c in completions)
    assert_consistent(engine, PROMPTS, completions, temperature)


async def test_concurrent_calls_share_one_batch(engine: TransformersEngine) -> None:
    results: dict[int, list[Completion]] = {}

    async def call(i: int) -> None:
        sampling = Sampling(max_new_tokens=6, temperature=0.5 * i, seed=i)
        results[i] = await engine.generate(PROMPTS[: 1 + i % 3], sampling)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(call, i)

    stats = engine.statistics()
    assert stats.batches == 1
    assert stats.max_batch_rows == stats.rows == 1 + 2 + 3 + 1
    for i, completions in results.items():  # each caller got its own rows back, in order
        assert_consistent(engine, PROMPTS[: 1 + i % 3], completions, 0.5 * i)


async def test_call_larger_than_max_batch_is_split(tiny: Path) -> None:
    async with open_transformers_engine(tiny, max_batch=4) as engine:
        prompts = [PROMPTS[i % 3] for i in range(10)]
        completions = await engine.generate(prompts, Sampling(max_new_tokens=3, seed=0))
        assert len(completions) == 10
        assert engine.statistics().batches == 3
        assert engine.statistics().max_batch_rows == 4
        assert_consistent(engine, prompts, completions, 1.0)


async def test_stops_at_stop_token_and_keeps_it(tiny: Path) -> None:
    # Given a seeded run without stop tokens, and a token that first appears at position k
    sampling = Sampling(max_new_tokens=16, temperature=1.0, seed=5)
    async with open_transformers_engine(tiny, stop_token_ids=[]) as engine:
        [free] = await engine.generate([PROMPTS[0]], sampling)
    tokens = free.tokens.tolist()
    k = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    # When that token is the stop token, the same run ends right after it
    async with open_transformers_engine(tiny, stop_token_ids=[tokens[k]]) as engine:
        [stopped] = await engine.generate([PROMPTS[0]], sampling)
        assert stopped.tokens.tolist() == tokens[: k + 1]
        assert stopped.finish_reason == "stop"
        assert stopped.text == engine.tokenizer.decode(tokens[: k + 1], skip_special_tokens=True)


async def test_default_stop_tokens_are_eos_and_im_end(engine: TransformersEngine) -> None:
    tok = engine.tokenizer
    assert tok.eos_token_id in engine.stop_ids
    assert tok.convert_tokens_to_ids("<|im_end|>") in engine.stop_ids


async def test_same_seed_same_samples(engine: TransformersEngine) -> None:
    sampling = Sampling(max_new_tokens=10, temperature=1.0, seed=42)
    prompts = [PROMPTS[0], PROMPTS[0]]
    a = await engine.generate(prompts, sampling)
    b = await engine.generate(prompts, sampling)
    c = await engine.generate(prompts, Sampling(max_new_tokens=10, temperature=1.0, seed=43))
    assert [x.tokens.tolist() for x in a] == [x.tokens.tolist() for x in b]
    assert a[0].tokens.tolist() != a[1].tokens.tolist()  # rows of one call differ
    assert [x.tokens.tolist() for x in a] != [x.tokens.tolist() for x in c]


async def test_tiny_top_p_is_greedy(engine: TransformersEngine) -> None:
    [greedy] = await engine.generate([PROMPTS[1]], Sampling(max_new_tokens=8, temperature=0))
    [nucleus] = await engine.generate(
        [PROMPTS[1]], Sampling(max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=1))
    assert nucleus.tokens.tolist() == greedy.tokens.tolist()
    assert_consistent(engine, [PROMPTS[1]], [nucleus], 1.0)  # untruncated tempered logprobs


async def test_update_weights_changes_outputs_and_version(
    engine: TransformersEngine, tiny: Path, tmp_path: Path
) -> None:
    # Given new weights on disk
    model = load_model(tiny)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    greedy = Sampling(max_new_tokens=10, temperature=0.0)
    [before] = await engine.generate([PROMPTS[2]], greedy)
    # When they are loaded while a batch is running
    async with trio.open_nursery() as nursery:
        running: list[Completion] = []

        async def long_generation() -> None:
            running.extend(await engine.generate([PROMPTS[0]], Sampling(max_new_tokens=40)))

        nursery.start_soon(long_generation)
        await trio.testing.wait_all_tasks_blocked()  # the batch is in its worker thread
        await engine.update_weights(tmp_path, 7)
        assert running, "the update must wait for the running batch"
    # Then the running batch finished on the old weights, the next one uses the new ones
    assert running[0].weight_version == 0 and before.weight_version == 0
    [after] = await engine.generate([PROMPTS[2]], greedy)
    assert engine.weight_version == 7 and after.weight_version == 7
    assert after.tokens.tolist() != before.tokens.tolist()
    assert_consistent(engine, [PROMPTS[2]], [after], 0.0)


async def test_update_weights_rejects_a_foreign_checkpoint(
    engine: TransformersEngine, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    save_file({"not.a.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError):
        await engine.update_weights(tmp_path, 1)
    assert engine.weight_version == 0


async def test_cancelled_caller_rows_are_dropped(engine: TransformersEngine) -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        await engine.generate(PROMPTS, Sampling(max_new_tokens=4))
    [c] = await engine.generate([PROMPTS[0]], Sampling(max_new_tokens=4))
    assert len(c.tokens) == 4
    assert engine.statistics().rows == 1


async def test_bad_requests_raise(engine: TransformersEngine) -> None:
    with pytest.raises(ValueError):
        await engine.generate([[]], Sampling())
    with pytest.raises(ValueError):
        await engine.generate([[10**9]], Sampling())
    with pytest.raises(ValueError):
        await engine.generate([PROMPTS[0]], Sampling(top_p=0.0))
    assert await engine.generate([], Sampling()) == []
