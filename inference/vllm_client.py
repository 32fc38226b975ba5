"""The vLLM client behind the :class:`~inference.engine.Engine` interface.

vLLM servers (its CPU build on a laptop, ``streamrl up`` starts them:
:mod:`inference.vllm_server`; GPU servers anywhere) speak a token-in / token-out protocol
of their own; this module maps it onto the engine's guarantees. Balancing, stickiness per
episode, health checks and re-syncing a server that comes back are
:class:`~inference.http_engine.HTTPEngine`'s.

- ``generate``: one ``/inference/v1/generate`` per prompt (``token_ids``; the server must run
  with ``--enable-scale-out``), all of a batch on one server at once (it batches them
  continuously, and a group's shared prompt is computed once in its prefix cache);
  ``logprobs: 0`` returns the sampled token's logprob and ``weight_versions`` the version
  spans of its tokens. The text is decoded here, with the model's tokenizer (special
  tokens skipped), so the answers carry token ids only;
- logprobs: the server must run with ``--logprobs-mode processed_logprobs``: the logprob
  after temperature, which is what the learner recomputes (``log_softmax(logits / T)``;
  plain ``log_softmax(logits)`` for greedy). vLLM's default (``raw_logprobs``) is the
  logprob before temperature. With ``top_p < 1`` vLLM renormalises over the nucleus, which
  the learner does not: such a request is refused (:class:`ValueError`, the message's error);
- stops: the model's stop tokens (the in-process engine's: EOS, ``<|im_end|>`` and the
  generation config's) are sent as ``stop_token_ids``; the stop token is the last token;
- a weight update from a published directory: ``/pause?mode=abort`` (``interrupt="resubmit"``:
  running requests answer ``finish_reason: "abort"`` with their tokens so far and are
  resubmitted) or ``mode=keep`` (``interrupt="in_place"``: frozen, then continued under the
  new weights, ``weight_versions`` saying which token came from which version) ->
  ``/collective_rpc reload_policy(weights_path)`` (vLLM's ``reload_weights``, then a tied
  output head re-tied to the new embedding: ``inference/vllm_ext/streamrl_vllm_ext.py``;
  the server needs ``VLLM_SERVER_DEV_MODE=1`` and that worker extension) ->
  ``/update_weight_version`` -> ``/reset_prefix_cache`` (a cached prefix computed by the
  old weights must not serve the new ones) -> ``/resume``;
- the version a server serves: ``/weight_info``.

Both interrupt modes give the logprobs the learner recomputes. ``resubmit`` sends the
context again; ``in_place`` leaves the request on the server, which recomputes its context
under the new weights when it resumes (the prefix-cache reset preempts the frozen requests,
``reset_running_requests``). Measured on the tiny model, 1,800 tokens with an update
mid-way: the tokens after it within 4e-4 of a teacher-forced pass of the new weights, in
every variant tried (no reset, a reset, a reset of running requests);
tests/inference/test_engine_contract.py checks both modes.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
import trio

from streamrl.inference.engine import Completion
from streamrl.inference.http_engine import (
    HTTPEngine,
    ProtocolError,
    Server,
    open_http_engine,
    parse_version,
    version_spans,
)
from streamrl.protocol.messages import Sampling

GENERATE = "/inference/v1/generate"


def _completion(answer: Any, decode: Any) -> Completion:
    """One ``/inference/v1/generate`` answer (``output_mode: tokens``) as a Completion."""
    try:
        [choice] = answer["choices"]
        tokens = np.asarray(choice["token_ids"] or [], dtype=np.int32)
        content = (choice.get("logprobs") or {}).get("content") or []
        if [int(c["token_id"]) for c in content] != tokens.tolist():
            raise ProtocolError("logprobs do not match token_ids")
        logprobs = np.asarray([float(c["logprob"]) for c in content], dtype=np.float32)
        reason = choice["finish_reason"]
        versions = version_spans(choice.get("weight_versions"), len(tokens), 0)
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"malformed {GENERATE} answer: {exc!r}") from None
    if reason not in ("stop", "length", "abort"):
        raise ProtocolError(f"unknown finish_reason {reason!r}")
    if not np.isfinite(logprobs).all() or (logprobs > 1e-3).any():
        raise ProtocolError("logprobs must be finite and at most 0")
    version = int(versions[0]) if len(tokens) else 0
    return Completion(tokens=tokens, logprobs=logprobs, text=decode(tokens.tolist()),
                      finish_reason=reason, weight_version=version, versions=versions)


class VLLMEngine(HTTPEngine):
    """See the module docstring. Use :func:`open_vllm_engine`."""

    kind = "vllm"

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str], *, tokenizer: Any,
                 stop_token_ids: Iterable[int], router_url: str = "",
                 interrupt: str = "resubmit", vocab_size: int = 0) -> None:
        super().__init__(client, urls, router_url=router_url, interrupt=interrupt,
                         vocab_size=vocab_size)
        self.tokenizer = tokenizer
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids})

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    async def _request(self, server: Server, prompts: list[list[int]],
                       sampling: Sampling) -> list[Completion]:
        if sampling.top_p < 1.0:
            raise ValueError(
                f"top_p {sampling.top_p}: vLLM reports logprobs renormalised over the top-p "
                "nucleus, which the learner does not recompute; use top_p = 1 with "
                "generator.engine 'vllm'")
        params: dict[str, Any] = {
            "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_p": 1.0, "logprobs": 0, "stop_token_ids": self.stop_token_ids,
            "detokenize": False,
        }
        batch = uuid.uuid4().hex[:12]
        answers: list[Completion | None] = [None] * len(prompts)

        async def one(i: int) -> None:
            sp = dict(params)
            if sampling.seed is not None:  # each row its own stream, as the in-process engine
                sp["seed"] = sampling.seed + i
            answer = await self._post_answer(server, GENERATE, {
                "token_ids": prompts[i], "sampling_params": sp, "output_mode": "tokens",
                "request_id": f"{batch}-{i}",
            })
            answers[i] = _completion(answer, self._decode)

        failed: list[Exception] = []

        async def guarded(i: int, cancel: trio.CancelScope) -> None:
            try:
                await one(i)
            except Exception as exc:  # the first failure is the batch's, unwrapped
                failed.append(exc)
                cancel.cancel()

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(guarded, i, nursery.cancel_scope)
        if failed:
            raise failed[0]
        return [a for a in answers if a is not None]

    async def _serving_version(self, server: Server) -> int:
        response = await self.client.get(server.url + "/weight_info")
        response.raise_for_status()
        info = response.json()
        if not isinstance(info, dict):
            raise ProtocolError("/weight_info: expected a JSON object")
        return parse_version(info.get("weight_version"))

    async def _load(self, server: Server, path: str, version: int) -> None:
        mode = "abort" if self.interrupt == "resubmit" else "keep"
        await self._post(server, "/pause", params={"mode": mode})
        try:
            answer = await self._post(server, "/collective_rpc", {
                "method": "reload_policy", "kwargs": {"weights_path": path}})
            if "results" not in answer:
                raise ProtocolError(f"reload_weights: unexpected answer {answer}")
            await self._post(server, "/update_weight_version", {"new_version": str(version)})
            # frozen requests (keep) are preempted too: recomputed under the new weights
            reset = await self._post(server, "/reset_prefix_cache",
                                     params={"reset_running_requests": "true"})
            if reset.get("success") is False:
                raise ProtocolError("the prefix cache could not be reset")
        finally:
            with trio.CancelScope(shield=True):
                await self._post(server, "/resume")


@asynccontextmanager
async def open_vllm_engine(
    urls: Sequence[str], *, tokenizer: Any, stop_token_ids: Iterable[int], router_url: str = "",
    health_interval_s: float = 2.0, request_timeout_s: float = 600.0,
    interrupt: str = "resubmit", vocab_size: int = 0,
) -> AsyncIterator[VLLMEngine]:
    """A client with its health checks running (one probe done before it is handed out)."""
    def make(client: httpx.AsyncClient) -> VLLMEngine:
        return VLLMEngine(client, urls, tokenizer=tokenizer, stop_token_ids=stop_token_ids,
                          router_url=router_url, interrupt=interrupt, vocab_size=vocab_size)

    async with open_http_engine(make, health_interval_s=health_interval_s,
                                request_timeout_s=request_timeout_s, max_connections=512,
                                max_keepalive=256) as engine:
        yield engine
