"""An in-process CPU inference engine on Hugging Face transformers, driven by trio.

Guarantees (on top of those in :mod:`inference.engine`):
- concurrent ``generate`` calls from any number of trio tasks are merged: one batcher task
  takes every row queued so far (up to ``max_batch``) and decodes them as one static batch in
  a worker thread; requests with different sampling settings share a batch;
- a call with more prompts than ``max_batch`` is split across batches and reassembled;
- with ``batch_wait_s`` > 0 an idle batcher that gets a request waits that long for more
  before it starts decoding (requests arriving over HTTP a few ms apart share a batch
  instead of the first one running alone for a whole completion);
- ``update_weights`` does not wait for a running batch: the batcher applies it between two
  decoding steps (the batch goes on under the new weights, see :mod:`inference.decode`) or
  before the next batch; every token records the version that produced it
  (``Completion.versions``) and returns only once the engine serves that version;
- ``generate(..., abort=flag)``: once the ``threading.Event`` is set, the call's rows end
  before their next decoding step with the tokens so far (``finish_reason == "abort"``);
- with ``Sampling.seed`` set, prompt ``i`` of a call samples from a generator seeded by
  ``(seed, i)``: the same call gives the same tokens whenever the logits are the same (the
  same weights and batch shape; a different batch mix changes logits by float noise only,
  which can flip a near-tie);
- a failure inside the batcher propagates out of :func:`open_transformers_engine` and fails
  every waiting ``generate`` call with :class:`EngineClosed`; cancelling a caller drops its
  rows (a running batch finishes its other rows); closing the engine aborts a running batch
  within one decoding step;
- the model is held and run in ``dtype`` (``float32``; ``bfloat16``; ``auto``: bfloat16 where
  the CPU multiplies it in hardware, :func:`native_bf16`); a token's logprob is always the
  fp32 ``log_softmax`` of the logits the model gave, and weight updates (fp32 checkpoints)
  are cast as they are loaded.

Usage::

    async with open_transformers_engine(resolve_model("smollm2-135m")) as engine:
        completions = await engine.generate([prompt_ids], Sampling(temperature=1.0))
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import trio

from streamrl.inference.decode import Row, RowResult, decode_batch
from streamrl.inference.engine import Completion, stop_token_ids
from streamrl.models import load_model, load_tokenizer
from streamrl.protocol.messages import Sampling

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""What ``generator.dtype`` / ``serve-model --dtype`` name, besides ``auto``."""


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles or AVX512-BF16, which
    torch reaches through oneDNN); without either, bf16 is emulated and slower than fp32."""
    return bool(torch.backends.mkldnn.is_available() and (
        torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()))


def serving_dtype(name: str) -> torch.dtype:
    """The dtype an engine holds its weights and computes in: ``float32``, ``bfloat16``, or
    ``auto`` (bfloat16 where :func:`native_bf16`, else float32)."""
    if name == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: use 'auto', {', '.join(map(repr, DTYPES))}") from None


class EngineClosed(RuntimeError):
    """The engine stopped (closed or failed) before this request was answered."""


@dataclass(frozen=True)
class EngineStatistics:
    batches: int  # static batches decoded
    rows: int  # completions produced
    max_batch_rows: int  # largest batch so far
    forward_passes: int
    tokens: int  # completion tokens produced
    busy_s: float  # wall time spent decoding
    queued_rows: int  # rows waiting for a batch right now
    weight_version: int


@dataclass(eq=False)
class _Request:
    prompts: list[list[int]]
    sampling: Sampling
    results: list[Completion | None]
    remaining: int
    done: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None
    abandoned: bool = False
    abort: threading.Event | None = None


@dataclass(eq=False)
class _Update:
    """Weights waiting to be applied by the batcher (between batches or decoding steps)."""

    state: dict[str, torch.Tensor]
    version: int
    partial: bool = False  # some of the model's tensors only (a bucket of a broadcast)
    done: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None


def _row_generator(seed: int | None, index: int) -> torch.Generator:
    if seed is None:
        value = secrets.randbits(63)
    else:
        state = np.random.SeedSequence([seed & (2**64 - 1), index]).generate_state(1, np.uint64)
        value = int(state[0]) >> 1
    return torch.Generator().manual_seed(value)


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory (single or sharded ``*.safetensors``) or of one file."""
    from safetensors.torch import load_file

    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file at {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


class TransformersEngine:
    """See the module docstring. Construct it (blocking: loads the model), then run
    :meth:`serve_batches` in a nursery, or use :func:`open_transformers_engine`."""

    def __init__(
        self,
        model_dir: str | Path,
        max_batch: int = 32,
        threads: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
        weight_version: int = 0,
        batch_wait_s: float = 0.0,
        dtype: str = "float32",
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if threads is not None:
            torch.set_num_threads(threads)
        self.model_dir = Path(model_dir)
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.tokenizer = load_tokenizer(model_dir)
        self.dtype = serving_dtype(dtype)
        self.model = load_model(model_dir, dtype=self.dtype).eval()
        self.stop_ids = frozenset(stop_token_ids if stop_token_ids is not None else self._stops())
        self.pad_id = int(self.tokenizer.pad_token_id)
        self._vocab = int(self.model.config.vocab_size)
        self._max_len = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self._version = weight_version
        self._lock = trio.Lock()  # held while decoding a batch or swapping weights
        self._send, self._receive = trio.open_memory_channel[_Request | None](math.inf)
        # Weights waiting for the batcher (applied by its thread between decoding steps), and
        # the updates they supersede, answered when they are applied.
        self._update_lock = threading.Lock()
        self._pending: list[_Update] = []
        self._backlog: deque[tuple[_Request, int]] = deque()
        self._inflight: list[tuple[_Request, int]] = []
        self._unreceived_rows = 0  # sent to the channel, not yet taken by the batcher
        self._stats = {"batches": 0, "rows": 0, "max_batch_rows": 0, "forward_passes": 0,
                       "tokens": 0}
        self._busy_s = 0.0

    def _stops(self) -> set[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        return stop_token_ids(self.tokenizer, eos)

    @property
    def weight_version(self) -> int:
        return self._version

    def statistics(self) -> EngineStatistics:
        queued = self._unreceived_rows + sum(1 for req, _ in self._backlog if not req.abandoned)
        return EngineStatistics(
            **self._stats, busy_s=self._busy_s, queued_rows=queued, weight_version=self._version
        )

    # ------------------------------------------------------------------ public API

    async def generate(self, prompts: list[list[int]], sampling: Sampling, *,
                       abort: threading.Event | None = None) -> list[Completion]:
        self._validate(prompts, sampling)
        if not prompts:
            return []
        request = _Request([list(p) for p in prompts], sampling, [None] * len(prompts),
                           remaining=len(prompts), abort=abort)
        try:
            self._send.send_nowait(request)
            self._unreceived_rows += len(prompts)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise EngineClosed("engine is closed") from None
        try:
            await request.done.wait()
        finally:
            if not request.done.is_set():
                request.abandoned = True
        if request.error is not None:
            raise EngineClosed("engine stopped before answering") from request.error
        return [c for c in request.results if c is not None]

    async def update_weights(self, path: str | Path, version: int, *,
                             partial: bool = False) -> None:
        """Load ``path`` and have the batcher apply it at its next decoding step (a running
        batch goes on under it) or before its next batch; returns once applied (or
        superseded by a newer full update). A checkpoint that does not fit raises
        ValueError; with ``partial`` it may hold some of the model's tensors only (each
        must fit; the others keep their values: one bucket of a broadcast)."""
        state = await trio.to_thread.run_sync(read_safetensors, path)
        await trio.to_thread.run_sync(self._check_state, state, partial)
        update = _Update(state, version, partial)
        with self._update_lock:
            self._pending.append(update)
        try:
            self._send.send_nowait(None)  # wake an idle batcher
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise EngineClosed("engine is closed") from None
        await update.done.wait()
        if update.error is not None:
            raise EngineClosed("engine stopped before the update") from update.error

    async def serve_batches(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                            ) -> None:
        """Decode queued rows batch after batch, forever."""
        task_status.started()
        try:
            while True:
                if not self._backlog:
                    self._take(await self._receive.receive())
                    with trio.move_on_after(self.batch_wait_s):
                        while self.batch_wait_s and len(self._backlog) < self.max_batch:
                            self._take(await self._receive.receive())
                await trio.lowlevel.checkpoint()  # let callers woken with us enqueue too
                while True:
                    try:
                        self._take(self._receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                if self._pending:
                    await trio.to_thread.run_sync(self._apply_pending)
                batch = self._next_batch()
                if batch:
                    await self._run_batch(batch)
        except BaseException as exc:
            self._fail_all(exc)
            raise

    # ------------------------------------------------------------------ internals

    def _validate(self, prompts: list[list[int]], sampling: Sampling) -> None:
        if sampling.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
            raise ValueError("need temperature >= 0 and 0 < top_p <= 1")
        for p in prompts:
            if not p:
                raise ValueError("empty prompt")
            if min(p) < 0 or max(p) >= self._vocab:
                raise ValueError(f"token id out of range [0, {self._vocab})")
            if len(p) + sampling.max_new_tokens > self._max_len:
                raise ValueError(f"prompt + max_new_tokens exceeds {self._max_len} positions")

    def _take(self, request: _Request | None) -> None:
        if request is None:  # a weight update's wake-up call
            return
        self._unreceived_rows -= len(request.prompts)
        self._backlog.extend((request, i) for i in range(len(request.prompts)))

    def _next_batch(self) -> list[tuple[_Request, int]]:
        batch: list[tuple[_Request, int]] = []
        while self._backlog and len(batch) < self.max_batch:
            request, index = self._backlog.popleft()
            if not request.abandoned:
                batch.append((request, index))
        return batch

    async def _run_batch(self, batch: list[tuple[_Request, int]]) -> None:
        rows = []
        for request, i in batch:
            s = request.sampling
            rows.append(Row(
                prompt=request.prompts[i], max_new_tokens=s.max_new_tokens,
                temperature=s.temperature, top_p=s.top_p,
                generator=_row_generator(s.seed, i) if s.temperature > 0 else None,
                aborted=None if request.abort is None else request.abort.is_set,
            ))
        self._inflight = batch
        async with self._lock:
            start = time.perf_counter()
            results, forwards = await trio.to_thread.run_sync(partial(
                decode_batch, self.model, rows, self.stop_ids, self.pad_id,
                checkpoint=trio.from_thread.check_cancelled, weights=self._apply_pending,
            ))
            completions = await trio.to_thread.run_sync(self._completions, results)
            self._busy_s += time.perf_counter() - start
        self._inflight = []
        self._stats["batches"] += 1
        self._stats["rows"] += len(rows)
        self._stats["max_batch_rows"] = max(self._stats["max_batch_rows"], len(rows))
        self._stats["forward_passes"] += forwards
        self._stats["tokens"] += sum(len(r.tokens) for r in results)
        for (request, i), completion in zip(batch, completions, strict=True):
            request.results[i] = completion
            request.remaining -= 1
            if request.remaining == 0:
                request.done.set()

    def _completions(self, results: list[RowResult]) -> list[Completion]:
        return [
            Completion(
                tokens=np.asarray(r.tokens, dtype=np.int32),
                logprobs=np.asarray(r.logprobs, dtype=np.float32),
                text=self.tokenizer.decode(r.tokens, skip_special_tokens=True),
                finish_reason=r.finish_reason,  # type: ignore[arg-type]
                weight_version=r.versions[0] if r.versions else self._version,
                versions=np.asarray(r.versions, dtype=np.int32),
            )
            for r in results
        ]

    def _check_state(self, state: dict[str, torch.Tensor], partial: bool = False) -> None:
        """Refuse a checkpoint that does not fit the model, before anything is changed."""
        own = self.model.state_dict()
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        missing = set() if partial else set(own) - set(state) - tied
        unexpected = set(state) - set(own)
        wrong = [k for k in set(state) & set(own) if state[k].shape != own[k].shape]
        if missing or unexpected or wrong:
            raise ValueError(
                f"weights do not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}, wrong shape {sorted(wrong)[:5]}"
            )

    def _apply_pending(self) -> int:
        """In the batcher's thread: apply the newest waiting update (if any), answer it and
        those it supersedes; returns the version now served."""
        with self._update_lock:
            updates, self._pending = self._pending, []
        if updates:
            # In version order from the newest full update (it supersedes the ones before
            # it); partial updates after it each add their tensors.
            updates.sort(key=lambda u: u.version)
            full = [i for i, u in enumerate(updates) if not u.partial]
            for update in updates[full[-1] if full else 0:]:
                self.model.load_state_dict(update.state, strict=False)
            self._version = updates[-1].version
            trio.from_thread.run_sync(_set_all, updates)
        return self._version

    def _fail_all(self, exc: BaseException) -> None:
        self._send.close()
        pending = [req for req, _ in [*self._inflight, *self._backlog]]
        while True:
            try:
                request = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if request is not None:
                pending.append(request)
        with self._update_lock:
            updates, self._pending = self._pending, []
        for update in updates:
            update.error = exc
            update.done.set()
        for req in pending:
            if not req.done.is_set():
                req.error = exc
                req.done.set()
        self._backlog.clear()


def _set_all(updates: list[_Update]) -> None:
    for update in updates:
        update.done.set()


@asynccontextmanager
async def open_transformers_engine(
    model_dir: str | Path,
    *,
    max_batch: int = 32,
    threads: int | None = None,
    stop_token_ids: Iterable[int] | None = None,
    weight_version: int = 0,
    batch_wait_s: float = 0.0,
    dtype: str = "float32",
) -> AsyncIterator[TransformersEngine]:
    """Load the model (in a thread), start the batcher, hand out the engine; stop on exit."""
    engine = await trio.to_thread.run_sync(partial(
        TransformersEngine, model_dir, max_batch=max_batch, threads=threads,
        stop_token_ids=stop_token_ids, weight_version=weight_version, batch_wait_s=batch_wait_s,
        dtype=dtype,
    ))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.serve_batches)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()
