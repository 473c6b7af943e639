"""Held-out evaluation: the mean reward of sampled completions on held-out prompts, before and after RL.

train.main scores every task's held-out set with evaluate_all before and after RL (summary.json) and draws the
toy image grid with image_snapshot (images.png); evaluate.py scores checkpoints with the same functions. The
completions come from tasks.rollout with the exact sampler, and are scored by tasks.score.
"""
from __future__ import annotations

import random

import torch

import tasks
from infra import scale
from sample import derive_seed, generator
from tasks import Ctx

GRID_PROMPTS = 6  # toy image prompts drawn before and after RL for out_dir/images.png


def eval_examples(task: str, cfg, datasets: dict) -> list:
    """The held-out prompts: fixed toy draws from the test split, or the first eval_prompts of eval_data."""
    if task in tasks.TOY_TASKS:
        rng = random.Random(derive_seed(cfg.seed, "eval", task))
        return [tasks.make_example(task, rng, cfg, "test") for _ in range(cfg.eval_prompts)]
    return datasets.get(task, {}).get("test", [])[: cfg.eval_prompts]


def evaluate(model, ctx: Ctx, task: str, temperature: float, records: list | None = None, progress=None,
             prompt_means: list | None = None, stop=None) -> float | None:
    """Held-out mean reward: eval_samples completions per held-out prompt (one at temperature 0), each from a
    generator seeded by its index, so runs are paired and the world size changes nothing; ranks take
    interleaved rows of every 64-example batch. records: if given, receives one dict per scored row of this
    rank (index, prompt, output, reward); prompt_means: each held-out prompt's mean reward, over ranks (for a
    gain's paired standard error); progress(n) after each batch of n rows (evaluate.py's bar); stop() before
    each batch, on every rank (it raises to end a run on a signal: infra/outdir.py). None without held-out set."""
    cfg, device = ctx.cfg, ctx.device
    exs = eval_examples(task, cfg, ctx.datasets)
    if not exs:
        return None
    k = cfg.eval_samples if temperature > 0 else 1
    per_prompt = torch.zeros(len(exs), dtype=torch.float64, device=device)  # summed reward of each prompt
    exs = [ex for ex in exs for _ in range(k)]
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of rewards, count)
    # Entered by every rank, also one without rows in some batch (tasks.rollout's own is then a no-op).
    with scale.full_weights(model):
        for i in range(0, len(exs), 64):
            if stop is not None:
                stop()
            mine = slice(scale.rank(), None, scale.world())
            b = tasks.make_batch(task, exs[i:i + 64], ctx.tok, ctx.ids, cfg, device, with_targets=False).rows(mine)
            idx = list(range(i, min(i + 64, len(exs))))[mine]
            if not idx:
                continue
            gens = [generator(device, cfg.seed, "eval-sampling", task, temperature, j) for j in idx]
            b, _ = tasks.rollout(model, b, ctx, gens, temperature)
            r = tasks.score(b, tasks.verifier(task, cfg.text_reward), ctx.tok, ctx.ids, ctx.scorer)
            total += torch.tensor([r.sum().item(), len(r)], dtype=torch.float64, device=device)
            per_prompt.index_add_(0, torch.tensor([j // k for j in idx], device=device), r.to(device, torch.float64))
            if progress is not None:
                progress(len(idx))
            if records is not None:
                outs = tasks.decode_window(b, ctx.tok, ctx.ids)
                records.extend({"index": j, "prompt": ex["prompt"], "output": o, "reward": float(v)}
                               for j, ex, o, v in zip(idx, b.examples, outs, r.tolist()))
    total = scale.all_sum(total)
    if prompt_means is not None:
        prompt_means.extend((scale.all_sum(per_prompt) / k).tolist())
    return (total[0] / total[1]).item()


def evaluate_all(model, ctx: Ctx, prompt_means: dict | None = None, stop=None) -> dict:
    """Held-out mean reward per task (sampled), and greedy for text tasks; tasks without held-out data
    are left out. prompt_means: if given, receives the per-prompt means of each, under the same keys;
    stop: as evaluate's."""
    res = {}
    for task in tasks.task_list(ctx.cfg):
        for key, temperature in ((task, ctx.cfg.temperature), (f"{task}_greedy", 0.0)):
            if key != task and task in tasks.IMAGE_TASKS:  # images have no greedy decoding
                continue
            means = []
            r = evaluate(model, ctx, task, temperature, prompt_means=means, stop=stop)
            if r is None:
                break
            res[key] = r
            if prompt_means is not None:
                prompt_means[key] = means
    return res


def image_snapshot(model, ctx: Ctx) -> list | None:
    """Toy images for the first GRID_PROMPTS held-out prompts, each from its own fixed generator, so the
    before and after pictures differ only by the policy. None without the toy image task."""
    if "image" not in tasks.task_list(ctx.cfg):
        return None
    exs = eval_examples("image", ctx.cfg, {})[:GRID_PROMPTS]
    if not exs:
        return None
    b = tasks.make_batch("image", exs, ctx.tok, ctx.ids, ctx.cfg, ctx.device, with_targets=False)
    gens = [generator(ctx.device, ctx.cfg.seed, "grid", i) for i in range(len(exs))]
    return tasks.decode_window(tasks.rollout(model, b, ctx, gens, ctx.cfg.temperature)[0], ctx.tok, ctx.ids)
