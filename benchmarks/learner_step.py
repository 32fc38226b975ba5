"""Claim: the wall time (and peak memory) of one ``Trainer.step`` on the real policy: plain
(every row computes its whole prompt), with each group's prompt computed once for its rows
(``shared_prefix``, :mod:`learner.prefix`, the default), and with gradient checkpointing.

Workload: ``--groups`` GRPO groups of ``--group-size`` samples, each ``--prompt-len`` prompt +
``--completion-len`` completion tokens (random ids, fixed seed, rewards with variance so that no
group is dropped; a group's prompt is shared by its samples). Each configuration runs in its
own process (so peak RSS is its own): one warm-up step, then ``--steps`` timed steps; a
no-grad forward over the same batch is timed in the same process. ``plain`` is the baseline:
``shared_prefix_speedup`` is its median step time over ``shared``'s, ``checkpointing_slowdown``
``checkpointing``'s over it. Prints one JSON object.

    .venv/bin/python benchmarks/learner_step.py                  # smollm2-135m, 8 x (60 + 48)
    .venv/bin/python benchmarks/learner_step.py --model tiny --steps 1
    .venv/bin/python benchmarks/learner_step.py --groups 3 --group-size 8 --prompt-len 51 \
        --completion-len 32 --threads 1 --steps 3                # the demo's step (arith)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


MODES = ("plain", "shared", "checkpointing")


def run_one(args: argparse.Namespace, mode: str) -> dict[str, object]:
    import torch

    from streamrl.learner.batch import build_batch
    from streamrl.learner.train import TrainConfig, Trainer, token_logprobs
    from streamrl.models import load_model, resolve_model
    from streamrl.testing.messages import make_trajectory

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    groups = []
    for _ in range(args.groups):
        prompt = ids(args.prompt_len)
        completions = [ids(args.completion_len) for _ in range(args.group_size)]
        logprobs = [[-2.0] * args.completion_len for _ in completions]
        rewards = [float(i % 2) for i in range(args.group_size)]
        groups.append(make_trajectory(prompt, completions, logprobs, rewards, temperature=1.0))

    shared = {"plain": {"shared_prefix": 0}, "shared": {}, "checkpointing": {}}[mode]
    trainer = Trainer(
        model,
        TrainConfig(lr=1e-6, grad_checkpointing=mode == "checkpointing",
                    micro_batch_size=args.micro_batch_size, **shared),
    )  # fmt: skip
    trainer.step(groups)  # warm-up
    step_times = []
    for _ in range(args.steps):
        stats = trainer.step(groups)
        step_times.append(stats.seconds)

    batch = build_batch(groups, pad_id=trainer.pad_id)
    started = time.perf_counter()
    with torch.no_grad():  # micro-batch by micro-batch, as the step's forward goes
        for mb in batch.micro_batches(args.micro_batch_size):
            token_logprobs(trainer.model, mb, shared_prefix=trainer.shared_prefix)
    forward_s = time.perf_counter() - started

    return {
        "mode": mode,
        "shared_prefix": trainer.shared_prefix,
        "step_seconds": step_times,
        "step_seconds_median": statistics.median(step_times),
        "tokens_trained_per_step": stats.tokens,
        "sequence_tokens_per_second": batch.lengths.sum().item() / statistics.median(step_times),
        "no_grad_forward_seconds": forward_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=60)
    parser.add_argument("--completion-len", type=int, default=48)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--only", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.only:
        print(json.dumps(run_one(args, args.only)))
        return

    import torch

    results = []
    for mode in MODES:
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--only", mode],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    plain, shared, checkpointing = (r["step_seconds_median"] for r in results)
    print(json.dumps({
        "benchmark": "learner_step",
        "model": args.model,
        "samples": args.groups * args.group_size,
        "prompt_len": args.prompt_len,
        "completion_len": args.completion_len,
        "micro_batch_size": args.micro_batch_size,
        "torch": torch.__version__,
        "torch_threads": args.threads or torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "results": results,
        "shared_prefix_speedup": plain / shared,
        "checkpointing_slowdown": checkpointing / plain,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
