"""TransformersEngine against a real (tiny, randomly initialised) Llama model."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
import trio.testing

from streamrl.inference.engine import Completion, Engine
from streamrl.inference.transformers_engine import TransformersEngine, open_transformers_engine
from streamrl.models import load_model, resolve_model
from streamrl.protocol.messages import Sampling
from streamrl.testing.logprobs import teacher_forced_logprobs

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
    return teacher_forced_logprobs(model, prompt, c.tokens.tolist(), temperature)


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


def perturbed(tiny: Path, out: Path, seed: int = 0) -> torch.nn.Module:
    """The tiny model with every weight moved, saved to ``out`` (HF layout)."""
    model = load_model(tiny)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(out, safe_serialization=True)
    return model.eval()


def assert_interrupted(old: torch.nn.Module, new: torch.nn.Module, prompt: list[int],
                       tokens: list[int], logprobs: list[float], versions: list[int],
                       before: int, after: int, temperature: float,
                       atol: float = 1e-3) -> int:
    """Tokens of both versions, in order; each token's logprob is its own version's
    teacher-forced one. Returns the index of the first token of the new version."""
    assert len(tokens) == len(logprobs) == len(versions)
    assert set(versions) == {before, after}, "the update must land mid-generation"
    k = versions.index(after)
    assert versions == [before] * k + [after] * (len(tokens) - k)
    c = Completion(np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32), "",
                   "length", before)
    got = torch.tensor(logprobs)
    # (float noise grows with the length: cached vs. one-pass attention over ~600 tokens)
    torch.testing.assert_close(got[:k], teacher_forced(old, prompt, c, temperature)[:k],
                               atol=atol, rtol=0)
    torch.testing.assert_close(got[k:], teacher_forced(new, prompt, c, temperature)[k:],
                               atol=atol, rtol=0)
    return k


async def test_update_lands_between_decoding_steps_of_a_running_batch(
    tiny: Path, tmp_path: Path
) -> None:
    # Given new weights on disk and a long generation running on the old ones
    old = load_model(tiny).eval()
    new = perturbed(tiny, tmp_path)
    greedy = Sampling(max_new_tokens=10, temperature=0.0)
    async with open_transformers_engine(tiny, stop_token_ids=[]) as engine:
        [before] = await engine.generate([PROMPTS[2]], greedy)
        running: list[Completion] = []
        async with trio.open_nursery() as nursery:

            async def long_generation() -> None:
                running.extend(await engine.generate(
                    [PROMPTS[0]], Sampling(max_new_tokens=600, temperature=1.0, seed=1)))

            nursery.start_soon(long_generation)
            await trio.testing.wait_all_tasks_blocked()  # the batch is in its worker thread
            await trio.sleep(0.1)  # some tokens under the old weights
            # When the update is loaded
            await engine.update_weights(tmp_path, 7)
            # Then it does not wait for the running batch
            assert not running and engine.weight_version == 7
        # And the long completion has tokens of both versions, in order, each with the
        # logprob of the weights that produced it (new ones: a fresh prefill, not the old cache)
        [c] = running
        assert len(c.tokens) == 600 and c.weight_version == 0
        k = assert_interrupted(old, new, PROMPTS[0], c.tokens.tolist(), c.logprobs.tolist(),
                               c.token_versions().tolist(), 0, 7, 1.0)
        assert 0 < k < 600
        # And the next batch runs wholly on the new weights
        [after] = await engine.generate([PROMPTS[2]], greedy)
        assert after.weight_version == 7 and set(after.token_versions().tolist()) == {7}
        assert after.tokens.tolist() != before.tokens.tolist()
        assert_consistent(engine, [PROMPTS[2]], [after], 0.0)


async def test_abort_flag_ends_rows_with_tokens_so_far(engine: TransformersEngine) -> None:
    flag = threading.Event()
    flag.set()
    # A request aborted before it starts ends with no tokens
    [empty] = await engine.generate([PROMPTS[0]], Sampling(max_new_tokens=8), abort=flag)
    assert empty.finish_reason == "abort" and len(empty.tokens) == 0
    # One aborted while running ends with the tokens it has, the other rows go on
    flag = threading.Event()
    out: dict[str, list[Completion]] = {}

    async def call(name: str, n: int, abort: threading.Event | None) -> None:
        out[name] = await engine.generate([PROMPTS[1]], Sampling(max_new_tokens=n, seed=2),
                                          abort=abort)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, "aborted", 1500, flag)
        nursery.start_soon(call, "kept", 1500, None)
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.05)
        flag.set()
    [aborted], [kept] = out["aborted"], out["kept"]
    stops = engine.stop_ids
    if kept.finish_reason == "length":
        assert len(kept.tokens) == 1500
    assert aborted.finish_reason == "abort" or set(aborted.tokens.tolist()) & stops
    assert len(aborted.tokens) < 1500
    assert_consistent(engine, [PROMPTS[1]], [aborted], 1.0)


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


async def test_batch_wait_merges_requests_arriving_apart(tiny: Path) -> None:
    # Given an engine that waits 0.5 s for more requests once it gets one
    async with open_transformers_engine(tiny, batch_wait_s=0.5) as engine:
        async with trio.open_nursery() as nursery:
            # When two calls arrive 50 ms apart (as over HTTP)
            nursery.start_soon(engine.generate, [PROMPTS[0]], Sampling(max_new_tokens=4))
            await trio.sleep(0.05)
            nursery.start_soon(engine.generate, [PROMPTS[1]], Sampling(max_new_tokens=4))
        # Then they were decoded as one batch
        assert engine.statistics().batches == 1 and engine.statistics().rows == 2
