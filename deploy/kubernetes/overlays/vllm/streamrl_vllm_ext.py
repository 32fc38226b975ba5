"""Runs inside vLLM's worker processes (``--worker-extension-cls
streamrl_vllm_ext.WeightReload``; this directory on their ``PYTHONPATH``): what streamrl
needs of a worker that vLLM does not do right by itself. Imports only what a vLLM
environment has (torch); nothing of streamrl.

``reload_policy(weights_path)`` (through ``/collective_rpc``) reloads a published weights
directory in place with vLLM's own ``reload_weights``, then repairs a tied output head.
vLLM 0.32's layerwise reload loads no weight for the head of a model whose
``tie_word_embeddings`` is set (its checkpoint has none: the head is the embedding), and
falls back to the head's *old* kernel tensors: the model then reads its input with the new
embedding and writes its logits with the old one (SmolLM2 is such a model). Here the head
is tied to the reloaded embedding again and its kernel (the CPU's packed GEMM weight)
rebuilt from it, so every logit comes from the new weights
(tests/inference/test_engine_contract.py checks them against a teacher-forced pass).
"""

from __future__ import annotations

from typing import Any


class WeightReload:
    """A mix-in of vLLM's worker class (vLLM adds it to the worker's bases)."""

    model_runner: Any

    def reload_policy(self, weights_path: str) -> dict[str, Any]:
        self.model_runner.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        config = getattr(model, "config", None)
        retied = False
        if getattr(config, "tie_word_embeddings", False) and head is not None and embed is not None:
            head.weight = embed.weight
            method = getattr(head, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(head)
            retied = True
        return {"weights_path": weights_path, "retied_head": retied}
