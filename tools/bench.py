"""Rollout speed of sample.generate and sample.fast_generate against LLaDA's public generate() (a benchmark).

    python -m tools.bench --threads 1           # both random models, one repetition
    python -m tools.bench --quick --threads 1   # smoke run: gen length 64, a 2-layer 256-d "llada"
    python -m tools.bench --ckpt out/toy/sft --threads 1   # a trained checkpoint on toy text prompts
    python -m tools.bench --ckpt out/long/sft --preset toy_long --threads 1   # ... on the long toy's
    python -m tools.bench --reps 3              # medians of 3 interleaved repetitions
    python -m tools.bench --sandbox             # the code reward's sandbox instead: programs/s, kill time

One table, all measured in this run: tokens/second of LLaDA's public generate() loop (re-implemented below:
the output head and the softmax over the whole sequence at every step), of sample.generate's exact sampler
(the same tokens, the head only where a step chooses) and of sample.fast_generate's opt-in approximations,
Fast-dLLM's prefix and dual KV caches and its confidence-threshold parallel decoding (arXiv:2505.22618), alone
and combined; the speed ratio to the public loop; forward passes; token agreement with the public loop's output
at temperature 0; peak memory. Random models: prompt 64 (left-padded to 48-64 real tokens), gen length 128,
block 32, batch 8, steps 128: one token per step on the fixed schedule, at least one with a threshold
(`--gen_length 256` for longer answers; a default run took about 40 minutes on one core of a shared
2-core machine).

Models. Both random (no CPU-trainable model fills 128 tokens sensibly), init std 1/sqrt(d) rather than
LLaDA's 0.02: at 0.02 every masked position sees little but the mask embedding, all predict one token and
whole blocks repeat it. Random networks are still repetitive and chaotic, so stale cached keys move their
argmax more than a trained model's: the agreement column is a pessimistic bound (--ckpt measures a trained
model). The mask id's logit is pinned low (never_predict_mask), as in a trained LLaDA. A random model's
confidences carry no information, so each head is scaled (a logit temperature) to make threshold 0.9 with a
cache commit about as many tokens per forward pass as Fast-dLLM does on LLaDA-8B GSM8K (2.77 tokens/forward,
d3LLM leaderboard; calibrated offline with the dual cache at gen length 256): that sets the threshold rows' pass count, shown in
"tok/fwd"; the cache rows (one token per step) do not depend on it.
  toy    train.py's toy dims: d 128, 4 layers, MLP 384, vocab 150; head scale 16.
  llada  LLaDA-shaped: d 512, 4 layers, 8 heads, MLP 1536, vocab 32000; head scale 26 (--head_scale).
At this size the 32000-row head costs as much as the 4 layers; on LLaDA-8B it is ~6% of a forward pass.
--ckpt: a train.py checkpoint (e.g. the toy's sft/) on held-out toy text prompts, with the generation
settings of --preset (toy, or toy_long for the long toy's prompts, 32 tokens in blocks of 8) and 4x longer
(4x the blocks); the reward column scores the completions with tasks.py and the preset's text reward.

Time is wall clock around one generate() call; "x LLaDA" is the median over repetitions of the speed ratio
to the public loop in the same repetition (configurations interleaved, so other load hits them alike).
Peak memory: CUDA max_memory_allocated; on CPU the growth of the resident set during the call, polled each
millisecond from /proc/self/statm after handing freed heap back to the OS (glibc malloc_trim), so peaks
shorter than a millisecond can be missed. It is measured on the first repetition.
"""
import shlex
import sys

if __name__ == "__main__" and not __package__:  # run as a file, tools/ would shadow the project's modules
    sys.exit("run it from the project's root as a module: "
             + shlex.join(["python", "-m", "tools.bench", *sys.argv[1:]]))

import argparse
import contextlib
import ctypes
import os
import statistics
import threading
import time

import torch

from model import ModelConfig, Transformer
import sample
from infra import cli, hf
from sample import generate
from infra.sandbox import run_code

EOS = 0
P, K, B = 64, 32, 8
TOY_PRESETS = ("toy", "toy_long", "smoke")  # train.py's presets with the toy text task
CONFIGS = [  # name, kv_cache, threshold; "LLaDA generate()" is llada_generate below
    ("LLaDA generate()", "public", 0.0),
    ("exact, full head", "full head", 0.0),
    ("exact", "none", 0.0),
    ("prefix", "prefix", 0.0),
    ("dual", "dual", 0.0),
    ("threshold", "none", 0.9),
    ("prefix+threshold", "prefix", 0.9),
    ("dual+threshold", "dual", 0.9),
]


@torch.no_grad()
def llada_generate(model, prompt, attention_mask, gen_length, block_length, steps, mask_id):
    """LLaDA's public generate() at temperature 0 with low-confidence remasking, as that code computes it:
    the head and the softmax over all L positions at every step, then a per-row topk. Gives sample.generate's
    exact tokens (tests/test_sample.py checks the same loop against it); here it is the speed baseline."""
    b, p = prompt.shape
    x = torch.cat([prompt, prompt.new_full((b, gen_length), mask_id)], 1)           # (B, L)
    am = torch.cat([attention_mask, attention_mask.new_ones(b, gen_length)], 1)    # (B, L)
    spb = steps // (gen_length // block_length)
    for end in range(p + block_length, p + gen_length + 1, block_length):
        n = (x[:, end - block_length:end] == mask_id).sum(1).tolist()
        for i in range(spb):
            masked = x == mask_id                                                  # (B, L)
            logits = model(x, attention_mask=am)                                   # (B, L, V)
            x0 = logits.argmax(-1)                                                 # (B, L)
            conf = torch.softmax(logits, -1).gather(-1, x0[..., None]).squeeze(-1)  # (B, L)
            conf[:, end:] = -torch.inf
            x0 = torch.where(masked, x0, x)
            conf = torch.where(masked, conf, -torch.inf)
            for j in range(b):
                idx = torch.topk(conf[j], n[j] // spb + (i < n[j] % spb)).indices
                x[j, idx] = x0[j, idx]
    return x


# -----------------------------------------------------------------------------------------------------
# models


def never_predict_mask(model):
    """Pin the mask id's logit far below the others, as a trained LLaDA's: otherwise a random model's exact
    sampler commits the mask id now and then (it stays masked and competes again), which the fast paths never
    do, and rows would differ for that reason alone. Residual dimension 0 becomes a constant: the embedding
    writes c there and no block writes to it, so after ln_f it is positive at every position, and the head's
    mask row reads it with a large negative weight."""
    with torch.no_grad():
        model.wte.weight[:, 0] = model.wte.weight.std()
        for block in model.blocks:
            block.attn_out.weight[0] = 0
            block.ff_out.weight[0] = 0
        row = model.ff_out.weight[model.config.mask_token_id]
        row.zero_()
        row[0] = -1e4
    return model


def random_model(vocab, d_model, n_layers, n_heads, head_scale):
    cfg = ModelConfig(d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
                      mlp_hidden_size=3 * d_model, vocab_size=vocab, mask_token_id=vocab - 1, eos_token_id=EOS,
                      pad_token_id=EOS)
    model = Transformer(cfg).init_weights(torch.Generator().manual_seed(0), std=d_model ** -0.5)
    with torch.no_grad():
        model.ff_out.weight.mul_(head_scale)
    prompts = torch.randint(1, vocab - 1, (B, P), generator=torch.Generator().manual_seed(2))   # (B, P)
    # Rows keep 48..64 real tokens, left-padded with EOS: the batch > 1 padding case caches must get right.
    real = torch.linspace(48, P, B).long()                                                     # (B,)
    mask = (torch.arange(P)[None, :] >= P - real[:, None]).long()                              # (B, P)
    return never_predict_mask(model).eval(), prompts.masked_fill(mask == 0, EOS), mask


# -----------------------------------------------------------------------------------------------------
# measurement


class PeakMemory:
    """Peak memory growth in MB inside the `with` block (see the module docstring); nan if unmeasurable."""

    def __init__(self, device):
        self.cuda, self.peak, self.libc = device.type == "cuda", float("nan"), None
        if not self.cuda and os.path.exists("/proc/self/statm"):
            try:
                self.libc = ctypes.CDLL("libc.so.6")
            except OSError:
                pass

    @staticmethod
    def _rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _poll(self):
        while not self._stop.wait(0.001):
            self._max = max(self._max, self._rss())

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        elif self.libc is not None:
            self.libc.malloc_trim(0)
            self._base = self._max = self._rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = (torch.cuda.max_memory_allocated() - self._base) / 2**20
        elif self.libc is not None:
            self._stop.set()
            self._thread.join()
            self.peak = (max(self._max, self._rss()) - self._base) / 2**20


class FullHead(torch.nn.Module):
    """The model behind a forward that takes only (input_ids, attention_mask), as a Hugging Face model's:
    sample.generate then computes the head at every position and slices, which is what the exact sampler
    did before it passed logits_at (the "exact, full head" row)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids, attention_mask)


def run(model, prompts, mask, gen, kv_cache, threshold, memory):
    """One generate() call: (output, seconds, forward passes, peak MB or nan). gen: (gen_length, block, steps)."""
    calls = [0]
    hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    mem = PeakMemory(prompts.device) if memory else None
    sync = torch.cuda.synchronize if prompts.device.type == "cuda" else (lambda: None)
    mask_id = model.config.mask_token_id
    try:
        with mem or contextlib.nullcontext():
            sync()
            t0 = time.perf_counter()
            if kv_cache == "public":
                out = llada_generate(model, prompts, mask, *gen, mask_id)
            elif kv_cache == "full head":  # the same sampler on a model without logits_at: the head everywhere
                out = generate(FullHead(model), prompts, attention_mask=mask, gen_length=gen[0],
                               block_length=gen[1], steps=gen[2], mask_id=mask_id)
            else:
                out = sample.fast_generate(model, prompts, attention_mask=mask, gen_length=gen[0],
                                           block_length=gen[1], steps=gen[2], mask_id=mask_id, kv_cache=kv_cache,
                                           threshold=threshold)
            sync()
            seconds = time.perf_counter() - t0
    finally:
        hook.remove()
    return out, seconds, calls[0], mem.peak if mem else float("nan")


def bench(name, model, prompts, mask, gen, reps, configs, reward=None):
    """Print one table row per configuration; reward(out) -> mean reward adds a column."""
    stats = {c[0]: {"tps": [], "ratio": []} for c in configs}
    outs = {}
    p = prompts.shape[1]
    for rep in range(reps):
        base = None
        for cname, kv_cache, threshold in configs:
            out, sec, calls, peak = run(model, prompts, mask, gen, kv_cache, threshold, memory=rep == 0)
            tps = prompts.shape[0] * gen[0] / sec
            base = base or tps  # the public loop runs first in every repetition
            stats[cname]["tps"].append(tps)
            stats[cname]["ratio"].append(tps / base)
            if rep == 0:
                outs[cname] = out
                stats[cname].update(calls=calls, peak=peak)
    ref = outs[configs[0][0]]
    for cname, *_ in configs:
        s, out = stats[cname], outs[cname]
        assert torch.equal(out[:, :p], prompts), f"{cname} changed the prompt"
        agree = (out[:, p:] == ref[:, p:]).float().mean().item()
        extra = f" {reward(out):6.3f} |" if reward else ""
        print(f"| {name:5s} | {cname:16s} | {s['calls']:4d} | {gen[0] / s['calls']:7.2f} | "
              f"{statistics.median(s['tps']):8.1f} | {statistics.median(s['ratio']):6.2f}x | "
              f"{100 * agree:6.1f}% | {s['peak']:7.1f} |{extra}", flush=True)


def toy_prompts(ckpt, n, device, preset="toy"):
    """A train.py checkpoint with n held-out text prompts of the preset's toy task, left-padded, and its
    reward function."""
    import random

    import train
    import tasks
    from infra.hf import load_tokenizer

    model = hf.from_pretrained(ckpt, device=device).eval()
    tok = load_tokenizer(ckpt, model.config)
    ids = hf.token_ids(tok, model.config)
    cfg = train.parse_args(["--preset", preset])
    rng = random.Random(0)
    exs = [tasks.make_example("text", rng, cfg, "test") for _ in range(n)]
    b = tasks.make_batch("text", exs, tok, ids, cfg, device, with_targets=False)
    P_ = b.prompt_len

    def reward(out):  # the whole completion, however long, through the toy verifier
        b_out = tasks.Batch("text", out, torch.ones_like(out), P_, out.shape[1] - P_, examples=exs)
        return tasks.score(b_out, tasks.verifier("text", cfg.text_reward), tok, ids).mean().item()
    gens = [(cfg.gen_length, cfg.block_length, cfg.steps), (4 * cfg.gen_length, cfg.block_length, 4 * cfg.steps)]
    return model, b.x[:, :P_], b.attention_mask[:, :P_], gens, reward


# -----------------------------------------------------------------------------------------------------
# sandbox throughput (--sandbox): code-task rollouts wait on it, one run_code call per completion

SANDBOX_TASKS = [  # MBPP-style: a reference solution and its three asserts, all passing
    ("def add(a, b):\n    return a + b",
     ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]),
    ("def rev(s):\n    return s[::-1]", ["assert rev('abc') == 'cba'", "assert rev('') == ''", "assert rev('a') == 'a'"]),
    ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
     ["assert fib(0) == 0", "assert fib(10) == 55", "assert fib(30) == 832040"]),
    ("import re\ndef words(s):\n    return re.findall(r'[a-z]+', s.lower())",
     ["assert words('Hi there') == ['hi', 'there']", "assert words('') == []", "assert words('a1b') == ['a', 'b']"]),
]


def bench_sandbox(programs, loop_timeout=1.0):
    """Programs/s and tests/s of sequential run_code calls, then how long an endless loop takes to be killed."""
    tasks = [SANDBOX_TASKS[i % len(SANDBOX_TASKS)] for i in range(programs)]
    t0 = time.perf_counter()
    scores = [run_code(program, tests) for program, tests in tasks]
    seconds = time.perf_counter() - t0
    assert all(score == 1.0 for score in scores), f"a reference solution failed in the sandbox: {scores}"
    n_tests = sum(len(tests) for _, tests in tasks)
    print(f"sandbox ({'root: uid switch + namespaces' if os.geteuid() == 0 else 'not root: rlimits only'}): "
          f"{programs} programs, {n_tests} tests in {seconds:.2f}s = {programs / seconds:.1f} programs/s, "
          f"{n_tests / seconds:.1f} tests/s (one call at a time, one forked worker per test)")
    t0 = time.perf_counter()
    score = run_code("while True:\n    pass", ["assert True"], timeout=loop_timeout)
    print(f"endless loop, timeout {loop_timeout:.1f}s: reward {score}, killed and reaped after "
          f"{time.perf_counter() - t0:.2f}s")


def main(argv=None):
    p = argparse.ArgumentParser(description="Tokens/second of sample.generate, exact and fast, vs LLaDA generate()",
                                allow_abbrev=False, exit_on_error=False)  # errors: one line (infra/cli.py)
    p.add_argument("--quick", action="store_true", help="smoke run: gen length 64 and a 2-layer 256-d 'llada'")
    p.add_argument("--reps", type=int, default=1, help="interleaved repetitions; the table shows medians")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--gen_length", type=int, default=128, help="tokens per answer (random models; a multiple of 32)")
    p.add_argument("--head_scale", type=float, default=26.0, help="logit scale of the 'llada' head (docstring)")
    p.add_argument("--ckpt", default="", help="a train.py checkpoint directory: its toy text prompts instead")
    p.add_argument("--prompts", type=int, default=64, help="held-out toy prompts with --ckpt")
    p.add_argument("--preset", default="toy", choices=TOY_PRESETS,
                   help="with --ckpt: the train.py preset whose text prompts, lengths and reward are used")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--sandbox", action="store_true", help="time the code sandbox instead of the sampler")
    p.add_argument("--programs", type=int, default=100, help="programs run through the sandbox by --sandbox")
    args = cli.parse_known(p, argv, "tools.bench")
    if args.sandbox:
        if args.programs < 1:
            raise ValueError(f"--programs must be >= 1, got {args.programs}")
        return bench_sandbox(args.programs)
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    if args.preset != "toy" and not args.ckpt:
        raise ValueError(f"--preset {args.preset} chooses the prompts of --ckpt, which is not given; add --ckpt DIR")
    if args.gen_length < K or args.gen_length % K:
        raise ValueError(f"--gen_length must be a positive multiple of the block length {K}, got {args.gen_length}")
    cli.check_threads(args.threads)
    cli.check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}, load average {load}, "
          f"reps {args.reps}, temperature 0")
    head = "| model | sampler          | fwd  | tok/fwd | tokens/s | x LLaDA |  agree  | peak MB |"
    rule = "|-------|------------------|------|---------|----------|---------|---------|---------|"
    if args.ckpt:
        model, prompts, mask, gens, reward = toy_prompts(args.ckpt, args.prompts, device, args.preset)
        for gen in gens:
            print(f"\n{args.ckpt}: {len(prompts)} toy text prompts ({prompts.shape[1]} tokens, left-padded), "
                  f"gen {gen[0]}, block {gen[1]}, steps {gen[2]}\n")
            print(head + " reward |\n" + rule + "--------|")
            bench("ckpt", model, prompts, mask, gen, args.reps, CONFIGS, reward)
    else:
        gen_length = 64 if args.quick else args.gen_length
        big = (256, 2, 4) if args.quick else (512, 4, 8)
        models = {"toy": random_model(150, 128, 4, 4, 16.0), "llada": random_model(32000, *big, args.head_scale)}
        print(f"prompt {P} (left-padded), gen {gen_length}, block {K}, batch {B}, steps {gen_length}\n")
        print(head + "\n" + rule)
        for name, (model, prompts, mask) in models.items():
            bench(name, model.to(device), prompts.to(device), mask.to(device), (gen_length, K, gen_length),
                  args.reps, CONFIGS)
    if hasattr(os, "getloadavg"):
        print(f"\nload average at the end {os.getloadavg()}")


if __name__ == "__main__":
    with cli.user_errors():
        main()
