"""Why the estimator works, measured: each importance estimator against the exact decoding log-ratio.

    python -m tools.diagnose --ckpt out/toy/sft                  # text and image, toy settings
    python -m tools.diagnose --ckpt out/toy_long/sft --preset toy_long --tasks=text
    python -m tools.diagnose --official_ratios   # the official AR-like operator's effective mask ratios

GRPO needs log pi_theta(o) - log pi_old(o) for each rollout o. For a masked diffusion model the exact
value along the path the sampler took is the decoding log-likelihood difference
Delta = l_theta(o) - l_old(o), l_pi(o) = sum_s sum_{k revealed at step s} log pi(o_k | c, x^(s))
(importance.decoding_logprob, from the order the sampler recorded). The estimators instead sum per-token
log-ratios on one seeded masked copy of o (importance.build_masks + token_logprobs, the code training
runs). This script measures, in the training regime, how well each estimate tracks Delta:

1. pi_old = the checkpoint. Rollouts from pi_old for prompts_per_step x group_size sequences per task,
   with the decoding order sample.rollout returns (and the generators train.rl_step uses).
2. One real MaskGRPO step with the Config's settings (train.rl_step on a copy of pi_old): theta_j is the
   policy after j of its mu updates, the one inner iteration j scores in training.
3. For j = 1 .. mu-1 and every sequence: Delta_j exactly; and, for each estimator, `draws` estimates
   (mask seeds differ between draws), each the sum of the log-ratios log pi_theta_j - log pi_old over the
   positions the estimator scores with the mask of iteration j.
4. Per estimator: Pearson and Spearman correlation of estimate and Delta over (sequence, j) pairs, one
   draw at a time then averaged; sign agreement; the spread over draws (mean standard deviation of one
   sequence's estimates over draws, divided by the standard deviation of Delta over sequences); the
   fraction of scored tokens whose ratio lies inside the clip range [1 - eps, 1 + eps].

It prints one table per task and writes a PNG (`--png`): estimate vs Delta per estimator, and the
masking probability by completion position of each reversing operator beside the sampler's measured
decode order (the paper's Fig. 2, measured on the model).
"""
from __future__ import annotations

import shlex
import sys

if __name__ == "__main__" and not __package__:  # run as a file, tools/ would shadow the project's modules
    sys.exit("run it from the project's root as a module: "
             + shlex.join(["python", "-m", "tools.diagnose", *sys.argv[1:]]))

import copy
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import importance
import tasks
import train
from infra import cli, plots
from sample import derive_seed, generator, rollout
from tasks import IMAGE_TASKS, draw_prompts, make_batch, task_list
from infra.cli import read_generation_settings, setup, validate
from infra.hf import load_tokenizer
from infra import hf

# (label, estimator, reversing mode, gamma or None for the Config's): the rows of the table.
ESTIMATORS = [("d1", "d1", "arlike", None), ("UniGRPO", "unigrpo", "random", None),
              ("MaskGRPO random", "maskgrpo", "random", None)] + \
             [(f"MaskGRPO AR-like g={g}", "maskgrpo", "arlike", g) for g in (0.0, 0.3, 0.6, 0.8)] + \
             [("MaskGRPO AR-like official", "maskgrpo", "arlike_official", None)]  # text only, as in the official code


# The train.Config settings the diagnosis takes: the sampling and RL step settings of the step it measures;
# the ones of a whole run (out_dir, SFT, model size, schedule, checkpoints, evaluation) are refused.
RUN_ONLY = {"out_dir", "init_from", "sft_dir", "retrain_sft", "d_model", "n_layers", "n_heads", "mlp_hidden_size",
            "vocab_size", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "text_noise", "image_noise",
            "sft_steps", "sft_batch_size", "sft_lr", "sft_warmup", "image_loss_weight", "cond_dropout", "rl_steps",
            "eval_prompts", "eval_samples", "sample_every", "checkpoint_every", "keep_last", "resume", "extend",
            "max_bad_steps", "dry_run", "dry_run_gpus", "eval_data", "train_data"}
SHARED = {f for f in train.Config.__dataclass_fields__} - RUN_ONLY
REFUSED = "a train.py setting of a whole run, which the diagnosis of one RL step does not use"


@dataclass
class Options(train.Config):
    ckpt: str = ""           # pi_old: a checkpoint in the Hugging Face layout with tokenizer.json
    draws: int = 4           # mask draws per estimator and inner iteration
    png: str = "diagnose.png"  # the estimate-vs-exact scatter and decode-order figure, in the current directory
                               # unless a path is given ("" = none)
    official_ratios: bool = False  # print the "arlike_official" effective-ratio table (docs/differences.md), no ckpt


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    den = (a.norm() * b.norm()).item()
    return (a @ b).item() / den if den > 0 else float("nan")


def ranks(v: torch.Tensor) -> torch.Tensor:
    """1-based ranks of v, ties given the mean of the ranks they span (so that equal values never look ordered)."""
    v = v.double().flatten()
    order = v.argsort()
    _, group, counts = torch.unique_consecutive(v[order], return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    out = torch.empty_like(v)
    out[order] = (ends - (counts.double() - 1) / 2)[group]
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation (Pearson of tie-averaged ranks); NaN when either side is all ties."""
    return pearson(ranks(a), ranks(b))


def metrics(draws: torch.Tensor, exact: torch.Tensor, ratios: torch.Tensor, clip_eps: float) -> dict:
    """The table's numbers for one estimator: draws (D, n) estimates, exact (n,) log-ratios, the per-token ratios.
    A correlation or sign agreement over nothing (Delta all zero: the policy did not move) is NaN, never 1."""
    moved = exact != 0  # the sign of a zero log-ratio is no direction to agree with
    return {
        "pearson": sum(pearson(d, exact) for d in draws) / len(draws),
        "spearman": sum(spearman(d, exact) for d in draws) / len(draws),
        "sign": (draws[:, moved].sign() == exact[moved].sign()).double().mean().item() if moved.any() else float("nan"),
        "spread": (draws.std(0).mean() / exact.std().clamp(min=1e-12)).item() if exact.std() > 0 else float("nan"),
        "in_clip": ((ratios - 1).abs() <= clip_eps).double().mean().item(),
        "scatter": (exact.tolist(), draws[0].tolist()),
    }


@torch.no_grad()
def estimate(theta, old, r, mask_in, mask_loss, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sum of log pi_theta - log pi_old over the scored positions of one mask, as training
    computes them (importance.token_logprobs), and the per-token ratios: ((B,), (T,))."""
    b = r.batch
    x_in = b.x.masked_fill(mask_in, ids.mask)
    kw = dict(attention_mask=b.attention_mask, vocab_slice=b.vocab_slice)
    lr = importance.token_logprobs(theta, x_in, b.x, mask_loss, **kw) - importance.token_logprobs(
        old, x_in, b.x, mask_loss, **kw)                                                  # (B, L)
    return lr.sum(-1), lr[mask_loss].exp()


class _Snapshots:
    """An optimizer that keeps a copy of the model after each of its first mu - 1 steps: theta_1 ..
    theta_{mu-1}, the policies inner iterations 1 .. mu-1 of train.rl_step score with."""

    def __init__(self, model, opt, mu: int):
        self.model, self.opt, self.mu, self.thetas = model, opt, mu, []

    def __getattr__(self, name):
        return getattr(self.opt, name)

    def step(self):
        self.opt.step()
        if len(self.thetas) < self.mu - 1:
            self.thetas.append(copy.deepcopy(self.model).eval())


def diagnose_task(o: Options, task: str, old, tok, ids, device) -> dict:
    cfg = replace(o, tasks=task)
    ctx = tasks.Ctx(cfg, tok, ids, device, {})
    # 1. rollouts from pi_old with the decoding order: rl_step's prompts and per-sequence generators at step 0
    exs = [ex for ex in draw_prompts(task, cfg, 0, {}) for _ in range(cfg.group_size)]
    b = make_batch(task, exs, tok, ids, cfg, device, with_targets=False)
    gens = [generator(device, cfg.seed, "rollout", task, 0, i) for i in range(len(exs))]
    b, order = rollout(old, b, ctx, gens, cfg.temperature)
    # 2. one MaskGRPO step from a copy of pi_old (the reference is pi_old itself, as in a run's first step);
    # it draws the same rollouts
    theta = copy.deepcopy(old)
    opt = _Snapshots(theta, torch.optim.AdamW(theta.parameters(), lr=cfg.lr, betas=(0.9, 0.99),
                                              weight_decay=cfg.weight_decay), cfg.mu)
    _, (r,) = train.rl_step(theta, old, opt, ctx, 0, tasks.step_prompts(ctx, 0))  # old: the reference (beta > 0)
    assert torch.equal(r.batch.x, b.x), "rl_step drew other rollouts than sample.rollout with its generators"
    thetas = opt.thetas
    # 3. exact Delta_j and every estimator's estimates
    b, kw = r.batch, dict(attention_mask=r.batch.attention_mask, vocab_slice=r.batch.vocab_slice, mask_id=ids.mask)
    l_old = importance.decoding_logprob(old, b.x, order, **kw)                           # (B,)
    deltas = [importance.decoding_logprob(t, b.x, order, **kw) - l_old for t in thetas]  # (mu-1) x (B,)
    B, L = b.x.shape
    window = torch.ones(B, b.window, dtype=torch.bool, device=device)
    eos_window = importance.completion_mask_until_eos(b.x[:, b.window_slice], ids.eos)
    rows = {}
    for label, est, mode, gamma in ESTIMATORS:
        if task in IMAGE_TASKS and mode == "arlike" and est == "maskgrpo" and gamma not in (None, cfg.gamma_image):
            continue  # images use random reversing only; one AR-like row at the image gamma is enough
        if task in IMAGE_TASKS and mode == "arlike_official":
            continue  # the official image path always reverses at random (remask_t2i)
        g = (cfg.gamma_image if task in IMAGE_TASKS else cfg.gamma_text) if gamma is None else gamma
        per_draw, ratios = [], []
        for k in range(o.draws):
            ins, outs = importance.build_masks(
                b.prompt_mask, eos_window if est == "d1" and task not in IMAGE_TASKS else window,
                seed=derive_seed(cfg.seed, "diagnose", task, label, k), step=0,
                seq_index=list(range(B)), mu=cfg.mu, gamma=g, estimator=est, mode=mode,
                p_mask_prompt=cfg.p_mask_prompt, suffix_len=L - b.prompt_len - b.window)
            ests = []
            for j, t in enumerate(thetas, start=1):
                e, rat = estimate(t, old, r, ins[j], outs[j], ids)
                ests.append(e)
                ratios.append(rat)
            per_draw.append(torch.cat(ests))                                             # ((mu-1) B,)
        exact = torch.cat(deltas)
        draws = torch.stack(per_draw)                                                     # (draws, (mu-1) B)
        rat = torch.cat(ratios)
        rows[label] = metrics(draws, exact, rat, cfg.clip_eps)
    rows["_order"] = order_curve(b, order, cfg, task)
    return rows


def order_curve(b, order, cfg, task: str) -> dict:
    """Fig. 2, measured: for a mask ratio t, the probability that completion position n is masked under
    each reversing operator, and the fraction of rollouts in which the sampler revealed position n in the
    last t of its steps (the state a ratio-t mask imitates)."""
    o = order[:, b.window_slice].double()                             # (B, N)
    N = b.window
    t = cfg.gamma_image if task in IMAGE_TASKS else cfg.gamma_text
    total = o.max().item() + 1
    sampler = (o >= (1 - t) * total).double().mean(0).tolist()                            # (N,)
    arlike = (1 - importance._arlike_keep(N, t)).tolist()
    return {"ratio": t, "sampler": sampler, "arlike": arlike, "random": [t] * N}


def official_ratio_table(prompt_lens=(20, 100, 150, 256), N: int = 256, gammas=(0.6, 0.8), mu: int = 12) -> str:
    """Markdown: the masked fraction of an N-token window under the official AR-like operator, per prompt length
    P and per ratio of the gamma schedules (importance.mask_ratios); the paper's operator masks the ratio itself."""
    lines = ["| gamma | nominal ratio t_j | " + " | ".join(f"P = {p}" for p in prompt_lens) + " |",
             "|---|---|" + "---|" * len(prompt_lens)]
    for g in gammas:
        for t in importance.mask_ratios(mu, g):
            cells = " | ".join(f"{importance.official_completion_ratio(p, N, t):.3f}" for p in prompt_lens)
            lines.append(f"| {g} | {t:.3f} | {cells} |")
    return "\n".join(lines)


def print_table(task: str, rows: dict) -> None:
    print(f"\n{task}: estimate vs exact decoding log-ratio (pooled over inner iterations j >= 1)")
    print("| estimator | Pearson | Spearman | sign agreement | spread / sd(Delta) | tokens in clip range |")
    print("|---|---|---|---|---|---|")
    shown = lambda v: f"{v:.3f}" if math.isfinite(v) else "undefined"
    for label, m in rows.items():
        if not label.startswith("_"):
            print(f"| {label} | {shown(m['pearson'])} | {shown(m['spearman'])} | {shown(m['sign'])} | "
                  f"{shown(m['spread'])} | {shown(m['in_clip'])} |")
    if any(not math.isfinite(m["spearman"]) for label, m in rows.items() if not label.startswith("_")):
        print(f"warning: {task}: a correlation is undefined: the exact log-ratios (or an estimate) are all equal, "
              "e.g. all 0 when the updates did not move the policy (a higher --lr, or more --mu); nothing was "
              "measured there")


def draw(results: dict, path: str) -> None:
    """One row of panels per task: a scatter per estimator, then the Fig. 2 panel."""
    if plots._extra("Pillow", "PIL") is None:
        return
    from PIL import Image, ImageDraw, ImageFont
    font = ImageFont.load_default(size=13)
    S, M = 170, 24
    ncol = max(len(r) for r in results.values())
    img = Image.new("RGB", (ncol * (S + M) + M, len(results) * (S + 2 * M) + 2 * M), "white")
    d = ImageDraw.Draw(img)
    d.text((M, img.height - M), "scatter: x = exact decoding log-ratio, y = one draw of the estimate. Last panel: "
           "P(position masked) at ratio t; black = the sampler's decode order, blue = AR-like reversing, "
           "orange = random reversing", fill=(0, 0, 0), font=font)
    for row, (task, rows) in enumerate(results.items()):
        y0 = M + row * (S + 2 * M)
        for col, (label, m) in enumerate(rows.items()):
            x0 = M + col * (S + M)
            d.rectangle([x0, y0, x0 + S, y0 + S], outline=(0, 0, 0))
            if label == "_order":
                d.text((x0, y0 - 16), f"{task}: P(masked), t={m['ratio']}", fill=(0, 0, 0), font=font)
                for name, colour in (("sampler", (0, 0, 0)), ("arlike", (30, 110, 190)), ("random", (230, 110, 20))):
                    ys = m[name]
                    pts = [(x0 + S * i / max(1, len(ys) - 1), y0 + S * (1 - v)) for i, v in enumerate(ys)]
                    d.line(pts, fill=colour, width=2)
                continue
            d.text((x0, y0 - 16), f"{task}: {label.replace('MaskGRPO ', '')}", fill=(0, 0, 0), font=font)
            ex, es = m["scatter"]
            lo_x, hi_x = min(ex), max(ex)
            lo_y, hi_y = min(es), max(es)
            for a, b in zip(ex, es):
                px = x0 + S * (a - lo_x) / max(hi_x - lo_x, 1e-12)
                py = y0 + S * (1 - (b - lo_y) / max(hi_y - lo_y, 1e-12))
                d.ellipse([px - 1.5, py - 1.5, px + 1.5, py + 1.5], fill=(30, 110, 190))
    img.save(path)
    print(f"wrote {Path(path).resolve()}")


def main(argv=None) -> dict:
    kw = dict(description=__doc__.split("\n")[0], presets=train.PRESETS, inherited=SHARED, refused=REFUSED)
    first = cli.parse(Options, argv, **kw)
    saved = read_generation_settings(first.ckpt) if first.ckpt else {}
    saved.pop("tasks", None)
    o = cli.parse(Options, argv, defaults=saved, **kw)
    if o.official_ratios:  # python -m tools.diagnose --official_ratios: the official text run's N 256, mu 12
        print(official_ratio_table())
        return {}
    if not o.ckpt:
        raise ValueError("usage: python -m tools.diagnose --ckpt DIR [--preset NAME] [--field=value ...]")
    if o.mu < 2 or o.draws < 2:
        raise ValueError(f"mu ({o.mu}) and draws ({o.draws}) must be >= 2")
    validate(replace(o, init_from=o.ckpt))
    device, _ = setup(o)
    old = hf.from_pretrained(o.ckpt, device=device, dtype=torch.float32).eval()
    tok = load_tokenizer(o.ckpt, old.config)
    ids = tasks.token_ids(tok)
    results = {}
    for task in task_list(o):
        results[task] = diagnose_task(o, task, old, tok, ids, device)
        print_table(task, results[task])
    if o.png:
        draw(results, o.png)
    return results


def run() -> None:
    """`python -m tools.diagnose ...`: main() with user errors as one line and exit status 2."""
    with cli.user_errors():
        main()


if __name__ == "__main__":
    run()
