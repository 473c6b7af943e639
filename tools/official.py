"""Measurements of what the official MaskGRPO runs did, for docs/differences.md (python -m tools.official).

Two behaviours of martian422/MaskGRPO grpo/mask_grpo_trainer.py that change what the released runs trained
with, measured without its code:

1. Rollout temperature. `add_gumbel_noise` casts the logits to the model dtype (bf16) and draws its uniforms
   in bf16 too, although its docstring asks for float64 (LLaDA; arXiv:2409.02908). gumbel_stats samples
   argmax(exp(l) / (-log u)^tau) both ways from one categorical and reports the entropy and top-1
   probability of the sampled tokens, beside softmax(l / tau), the distribution it should sample.
2. Inner-iteration indices. `compute_loss` picks the mask of iteration (_step mod mu) - 1, with -1 read as
   mu - 1, where _step counts micro-batches; strided_indices simulates that counter under gradient
   accumulation.

The effective mask ratios of the official AR-like operator are importance.official_completion_ratio
(`python -m tools.diagnose --official_ratios` prints the table).
"""
from __future__ import annotations


import shlex
import sys

if __name__ == "__main__" and not __package__:  # run as a file, tools/ would shadow the project's modules
    sys.exit("run it from the project's root as a module: "
             + shlex.join(["python", "-m", "tools.official", *sys.argv[1:]]))

import torch


def entropy_top1(probs: torch.Tensor) -> tuple[float, float]:
    """Entropy (nats) and largest probability of a distribution (V,)."""
    p = probs.double()
    nz = p[p > 0]
    return float(-(nz * nz.log()).sum()), float(p.max())


def gumbel_stats(logits: torch.Tensor, temperature: float, dtype: torch.dtype, draws: int,
                 generator: torch.Generator, chunk: int = 1000) -> tuple[float, float]:
    """Entropy and top-1 probability of the tokens drawn by argmax(exp(l) / (-log u)^tau) from logits (V,),
    every step in `dtype` as the official sampler does it (bf16 there; float64 here). draws: samples."""
    counts = torch.zeros(logits.numel(), dtype=torch.float64)
    lg = logits.to(dtype)
    for s in range(0, draws, chunk):
        n = min(chunk, draws - s)
        u = torch.rand(n, logits.numel(), generator=generator, dtype=dtype)      # (n, V)
        # The same Gumbel-max form as the official helper: ties in bf16 go to the lowest index.
        x = (lg.exp() / (-torch.log(u)) ** temperature).argmax(-1)              # (n,)
        counts += torch.bincount(x, minlength=logits.numel()).double()
    return entropy_top1(counts / draws)


def example_logits(V: int = 2000, scale: float = 6.0, seed: int = 0) -> torch.Tensor:
    """A fixed categorical over V tokens, rounded to bf16 as a bf16 model emits it: Gaussian logits times
    `scale`, which at tau 0.9 gives a target entropy of 2.09 nats (a token the model is unsure about)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g, dtype=torch.float64) * scale).to(torch.bfloat16).double()


def strided_indices(mu: int, grad_accum: int, optimizer_steps: int) -> list[list[int]]:
    """The inner-iteration index each gradient-accumulation slot scores at each optimizer step of the official
    trainer: [slot][step]. Micro-batch m (0-based) runs with _step = m + 1 (incremented in _prepare_inputs
    before compute_loss), hence index ((m + 1) mod mu) - 1, -1 read as mu - 1; slot m mod A, step m // A."""
    out = [[] for _ in range(grad_accum)]
    for m in range(optimizer_steps * grad_accum):
        idx = (m + 1) % mu - 1
        out[m % grad_accum].append(mu - 1 if idx == -1 else idx)
    return out


def main() -> None:
    logits = example_logits()
    tau = 0.9
    h, p = entropy_top1(torch.softmax(logits / tau, -1))
    print(f"categorical over {logits.numel()} tokens (bf16-rounded logits), tau {tau}:")
    print(f"  target softmax(l / tau): entropy {h:.3f}, top-1 {p:.3f}")
    for name, dtype in (("float64", torch.float64), ("bfloat16", torch.bfloat16)):
        h, p = gumbel_stats(logits, tau, dtype, 20000, torch.Generator().manual_seed(1))
        print(f"  Gumbel-max with {name} noise (20,000 draws): entropy {h:.3f}, top-1 {p:.3f}")
    for mu, accum, name in ((12, 2, "t2t_grpo_train.sh"), (6, 2, "t2i_grpo_train.sh"), (12, 4, "w_server, mu 12")):
        slots = strided_indices(mu, accum, mu)
        print(f"mu {mu}, gradient accumulation {accum} ({name}), one rollout batch = {mu} optimizer steps:")
        for s, idx in enumerate(slots):
            print(f"  slot {s}: {idx}")


if __name__ == "__main__":
    main()
