"""Episodes: prompts -> token batches -> sampled completions -> rewards, and held-out evaluation.

Everything MaskGRPO's loop (train.py) and the evaluation command (evaluate.py) share about *what* is
trained on: the toy tasks (tasks.py) and the benchmark files (data.py) turned into MMaDA/LLaDA token
layouts, rollouts with the samplers of sample.py (steps 1-2 of the loop in train.py's docstring), the
verifiers and the remote image scorer, and the held-out evaluation before and after RL.

Randomness is explicit and world-size free: importance.derive_seed hashes (run seed, purpose, step, index), and each
sequence is sampled from its own generator, so a sequence gets the same completion in any batch, on any
number of processes. `cfg` below is train.Config (duck-typed here to avoid a circular import).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

import rewards
import sample
import tasks
from importance import derive_seed, generator
from infra import data, scale
from infra.scale import print0
from model import ModelConfig, chat_prompt

TOY_TASKS = ("text", "image")
IMAGE_TASKS = ("image", "geneval")  # generated as image tokens; everything else is text


def task_list(cfg) -> list[str]:
    return [t for t in cfg.tasks.split(",") if t]


def data_paths(spec: str, name: str) -> dict[str, str]:
    """"gsm8k=a.jsonl,math=b.jsonl" -> {"gsm8k": "a.jsonl", "math": "b.jsonl"}."""
    out = {}
    for item in filter(None, spec.split(",")):
        task, eq, path = item.partition("=")
        if not eq or not path or task not in data.TASKS:
            raise ValueError(f"{name} entry {item!r} must be TASK=PATH with TASK one of {', '.join(data.TASKS)}")
        out[task] = path
    return out


# -----------------------------------------------------------------------------------------------------
# data: toy and benchmark examples -> token tensors


@dataclass
class Batch:
    """A batch of sequences laid out as [prompt (P) | window (N) | suffix (S)]. The window is what the
    model generates: the text completion, or the image slots between <|soi|> and <|eoi|>."""
    task: str
    x: torch.Tensor                 # (B, L) token ids; the window holds targets (SFT) or rollouts (RL)
    attention_mask: torch.Tensor    # (B, L) 1 = real token, 0 = left padding
    prompt_len: int                 # P
    window: int                     # N
    uncond: torch.Tensor | None = None       # (B, L) unconditional prompt for CFG (image)
    uncond_mask: torch.Tensor | None = None  # (B, L)
    examples: list | None = None

    @property
    def prompt_mask(self):          # (B, P) real prompt tokens (never masked by the MaskGRPO estimator)
        return self.attention_mask[:, : self.prompt_len].bool()

    @property
    def window_slice(self):
        return slice(self.prompt_len, self.prompt_len + self.window)

    def rows(self, rows: slice) -> "Batch":
        """This rank's rows of a global batch (same padding as every other rank's)."""
        pick = lambda t: None if t is None else t[rows]
        return Batch(self.task, self.x[rows], self.attention_mask[rows], self.prompt_len, self.window,
                     pick(self.uncond), pick(self.uncond_mask), self.examples[rows])


def make_batch(task: str, examples: list, tok, sp, cfg, device, with_targets: bool) -> Batch:
    """Token tensors for `examples`; the window holds the target (SFT) or mask ids (rollout prompts).
    Text prompts are left-padded to the longest in `examples`: build the *global* batch on every rank and
    take rows from it (Batch.rows), so that a sequence's padding, and hence its logits, do not depend on
    the world size."""
    if task in IMAGE_TASKS:
        return _image_batch(task, examples, tok, sp, cfg, device, with_targets)
    if task == "text":
        pairs = [tasks.encode_text(tok, ex, cfg.gen_length) for ex in examples]
    else:  # a benchmark prompt in the LLaDA chat template, cut from the left like the official code
        pairs = [(tok.encode(chat_prompt([{"role": "user", "content": ex["prompt"]}]) + cfg.prompt_prefill,
                             add_special_tokens=False).ids[-cfg.max_prompt_len:], None) for ex in examples]
    P = max(len(p) for p, _ in pairs)
    rows, att = [], []
    for p, c in pairs:
        pad = P - len(p)
        window = c if with_targets else [sp.mask] * cfg.gen_length
        rows.append([sp.pad] * pad + p + window)  # LLaDA left-pads prompts with EOS
        att.append([0] * pad + [1] * (len(p) + cfg.gen_length))
    x = torch.tensor(rows, device=device)
    return Batch(task, x, torch.tensor(att, device=device), P, cfg.gen_length, examples=examples)


def _image_batch(task, examples, tok, sp, cfg, device, with_targets: bool) -> Batch:
    """MMaDA's t2i layout (tasks.encode_image_prompt), with the empty-caption prompt for CFG."""
    n = cfg.image_width ** 2
    text_len = cfg.image_text_len or image_text_len(tok)
    enc = [tasks.encode_image_prompt(tok, ex["prompt"], text_len, n, sp) for ex in examples]
    unc = tasks.encode_image_prompt(tok, "", text_len, n, sp)
    x = torch.tensor([e[0] for e in enc], device=device)
    att = torch.tensor([e[2] for e in enc], device=device)
    start = enc[0][1]
    if with_targets:
        x[:, start:start + n] = torch.tensor([ex["image"] for ex in examples], device=device) + sp.image_token_offset
    B = len(examples)
    uncond = torch.tensor(unc[0], device=device).expand(B, -1).clone()
    uncond_mask = torch.tensor(unc[2], device=device).expand(B, -1).clone()
    return Batch(task, x, att, start, n, uncond, uncond_mask, examples)


def make_example(task: str, rng: random.Random, cfg, split: str, noise: float = 0.0) -> dict:
    if task == "text":
        return tasks.make_text_example(rng, split=split, noise=noise, max_steps=cfg.text_max_steps)
    return tasks.make_image_example(rng, split=split, noise=noise, width=cfg.image_width)


_TEXT_LEN: dict = {}


def image_text_len(tok) -> int:
    """Caption part of every t2i prompt, padded to the longest toy caption (computed once per vocabulary)."""
    key = tok.get_vocab_size(with_added_tokens=True)
    if key not in _TEXT_LEN:
        _TEXT_LEN[key] = tasks.image_text_len(tok)
    return _TEXT_LEN[key]


def vocab_slice(task: str, sp):
    """Image positions are scored over the image-code columns only (MMaDA arXiv:2505.15809: the image head predicts codes)."""
    return (sp.image_token_offset, sp.image_token_offset + sp.codebook_size) if task in IMAGE_TASKS else None


def model_specials(tok, mc: ModelConfig) -> tasks.Specials:
    """Token ids of a pretrained LLaDA/MMaDA checkpoint: from its config.json, and the MMaDA markers from
    its tokenizer by name (None where LLaDA has none; only the image tasks need them)."""
    return tasks.Specials(bos=mc.bos_token_id, eos=mc.eos_token_id, pad=mc.pad_token_id, mask=mc.mask_token_id,
                          t2i=tok.token_to_id("<|t2i|>"), soi=tok.token_to_id("<|soi|>"),
                          eoi=tok.token_to_id("<|eoi|>"), ipad=tok.token_to_id("[iPAD]"),
                          image_token_offset=mc.image_token_offset, codebook_size=mc.codebook_size,
                          vocab_size=mc.vocab_size)


def load_data(cfg) -> dict:
    """{task: {"train": examples, "test": examples}} for the benchmark tasks, read and checked before any
    model is loaded (data.py reports every malformed row with its file and line)."""
    out = {}
    evals = data_paths(cfg.eval_data, "eval_data")
    for task, path in data_paths(cfg.train_data, "train_data").items():
        out[task] = {"train": data.load_dataset(task, path),
                     "test": data.load_dataset(task, evals[task]) if task in evals else []}
    return out


def draw_prompts(task: str, cfg, step: int, datasets: dict) -> list:
    """The global prompts of one RL step, identical on every rank: toy tasks draw fresh examples from
    (seed, step); a dataset is walked in a fresh seeded permutation per epoch, so step s always sees the
    same prompts (and a resumed run continues where it stopped)."""
    if task in TOY_TASKS:
        rng = random.Random(derive_seed(cfg.seed, "rl-prompts", task, step))
        return [make_example(task, rng, cfg, "train") for _ in range(cfg.prompts_per_step)]
    rows = datasets[task]["train"]
    out, orders = [], {}
    for i in range(step * cfg.prompts_per_step, (step + 1) * cfg.prompts_per_step):
        epoch, pos = divmod(i, len(rows))
        if epoch not in orders:  # one shuffle per epoch touched by this step (at most two)
            orders[epoch] = list(range(len(rows)))
            random.Random(derive_seed(cfg.seed, "epoch", task, epoch)).shuffle(orders[epoch])
        out.append(rows[orders[epoch][pos]])
    return out


# -----------------------------------------------------------------------------------------------------
# rollouts, rewards, evaluation


@torch.no_grad()
def rollout(model, b: Batch, sp, cfg, gens: list, temperature: float, fast: bool = False,
            return_order: bool = False) -> tuple[Batch, torch.Tensor | None]:
    """Fill the window of every row with the policy's sample: (a new Batch with prompts unchanged, and
    the decoding order (B, L) when return_order, else None). gens: one generator per row, so a row's sample
    depends on its own seed only. Rows go through device_batch_size at a time. fast: use cfg.kv_cache /
    cfg.threshold for text (RL rollouts only; evaluation always uses the exact sampler)."""
    xs, orders = [], []
    with scale.full_weights(model):
        for rows in scale.chunks(len(gens), cfg.device_batch_size):
            c, g = b.rows(rows), gens[rows]
            if c.task not in IMAGE_TASKS:
                x = sample.generate(model, c.x[:, : c.prompt_len], gen_length=c.window,
                                    block_length=cfg.block_length, steps=cfg.steps, temperature=temperature,
                                    mask_id=sp.mask, generator=g, attention_mask=c.attention_mask[:, : c.prompt_len],
                                    kv_cache=None if not fast or cfg.kv_cache == "none" else cfg.kv_cache,
                                    threshold=(cfg.threshold or None) if fast else None, return_order=return_order)
            else:
                x = sample.generate_image(model, c.x, image_start=c.prompt_len, num_tokens=c.window,
                                          steps=cfg.image_steps, sampler=cfg.image_sampler, cfg_scale=cfg.cfg_scale,
                                          uncond_input_ids=c.uncond, generator=g, attention_mask=c.attention_mask,
                                          uncond_attention_mask=c.uncond_mask, code_offset=sp.image_token_offset,
                                          codebook_size=sp.codebook_size, mask_id=sp.mask, return_order=return_order)
            if return_order:
                x, order = x
                orders.append(order)
            xs.append(x)
    out = Batch(b.task, torch.cat(xs), b.attention_mask, b.prompt_len, b.window, b.uncond, b.uncond_mask, b.examples)
    return out, torch.cat(orders) if return_order else None


def decode_window(b: Batch, tok, sp) -> list:
    """Completion text (text tasks) or image codes (image tasks) per row."""
    w = b.x[:, b.window_slice].tolist()
    if b.task not in IMAGE_TASKS:
        return [tok.decode(row, skip_special_tokens=True) for row in w]
    return [[c - sp.image_token_offset for c in row] for row in w]


def score(b: Batch, tok, sp, scorer=None, shaped: bool = False) -> torch.Tensor:
    """Reward in [0, 1] per row: the toy verifiers (tasks.py), the benchmark verifiers (rewards.REWARDS,
    or rewards.SHAPED, the official format + correctness terms, where shaped and the task has them), or,
    for geneval images, the remote scorer."""
    outs = decode_window(b, tok, sp)
    if b.task == "geneval":
        try:
            return torch.tensor(scorer([ex["prompt"] for ex in b.examples], outs), dtype=torch.float32)
        except (ValueError, OSError, RuntimeError) as e:
            # Down, refusing, or replying NaN: NaN rewards, which the gathered check in collect turns into a
            # skipped step on every rank (a rank that raised alone would leave the others waiting).
            print(f"warning: image scorer failed ({e}); this batch gets NaN rewards", flush=True)
            return torch.full((len(outs),), math.nan)
    if b.task == "text":
        fn = tasks.text_reward
    elif b.task == "image":
        fn = lambda codes, ex: tasks.image_reward(codes, ex["spec"])
    else:
        fn = rewards.SHAPED[b.task] if shaped and b.task in rewards.SHAPED else rewards.REWARDS[b.task]
    return torch.tensor([fn(o, ex) for o, ex in zip(outs, b.examples)], dtype=torch.float32)


def eval_examples(task: str, cfg, datasets: dict) -> list:
    """The held-out prompts: fixed toy draws from the test split, or the first eval_prompts of eval_data."""
    if task in TOY_TASKS:
        rng = random.Random(derive_seed(cfg.seed, "eval", task))
        return [make_example(task, rng, cfg, "test") for _ in range(cfg.eval_prompts)]
    return datasets.get(task, {}).get("test", [])[: cfg.eval_prompts]


def evaluate(model, tok, sp, cfg, device, task: str, temperature: float, datasets: dict | None = None,
             scorer=None, records: list | None = None, progress=None) -> float | None:
    """Held-out mean reward: eval_samples completions per held-out prompt (one at temperature 0), each
    from a generator seeded by its index, so that runs are paired and the world size changes nothing.
    Ranks take interleaved rows of every 64-example batch. records: if given, one dict per scored row of
    this rank is appended (index, prompt, output, reward); progress(n) is called after each batch of n
    rows (evaluate.py's bar). None when the task has no held-out set."""
    exs = eval_examples(task, cfg, datasets or {})
    if not exs:
        return None
    exs = [ex for ex in exs for _ in range(cfg.eval_samples if temperature > 0 else 1)]
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of rewards, count)
    # Entered by every rank, also one without rows in some batch (rollout's own is then a no-op).
    with scale.full_weights(model):
        for i in range(0, len(exs), 64):
            mine = slice(scale.rank(), None, scale.world())
            b = make_batch(task, exs[i:i + 64], tok, sp, cfg, device, with_targets=False).rows(mine)
            idx = list(range(i, min(i + 64, len(exs))))[mine]
            if not idx:
                continue
            gens = [generator(device, cfg.seed, "eval-sampling", task, temperature, j) for j in idx]
            b, _ = rollout(model, b, sp, cfg, gens, temperature)
            r = score(b, tok, sp, scorer)
            total += torch.tensor([r.sum().item(), len(r)], dtype=torch.float64, device=device)
            if progress is not None:
                progress(len(idx))
            if records is not None:
                outs = decode_window(b, tok, sp)
                records.extend({"index": j, "prompt": ex["prompt"], "output": o, "reward": float(v)}
                               for j, ex, o, v in zip(idx, b.examples, outs, r.tolist()))
    total = scale.all_sum(total)
    return (total[0] / total[1]).item()


def show(b: Batch, rewards, tok, sp, n: int = 1) -> None:
    outs = decode_window(b, tok, sp)
    for i in range(n):
        prompt = b.examples[i]["prompt"]
        if b.task not in IMAGE_TASKS:
            print0(f"  [{b.task}] {prompt[-200:]!r} -> {outs[i]!r}  reward {rewards[i]:.2f}")
        else:
            print0(f"  [{b.task}] {prompt!r}  reward {rewards[i]:.2f}")
            if b.task == "image":  # toy palette codes; real VQ codes need the image decoder
                print0(tasks.render_image(outs[i], int(math.isqrt(len(outs[i])))))


def evaluate_all(model, tok, sp, cfg, device, datasets: dict | None = None, scorer=None) -> dict:
    """Held-out mean reward per task (sampled), and greedy for text tasks; tasks without held-out data
    are left out."""
    res = {}
    for task in task_list(cfg):
        r = evaluate(model, tok, sp, cfg, device, task, cfg.temperature, datasets, scorer)
        if r is None:
            continue
        res[task] = r
        if task not in IMAGE_TASKS:
            res[f"{task}_greedy"] = evaluate(model, tok, sp, cfg, device, task, 0.0, datasets, scorer)
    return res


# -----------------------------------------------------------------------------------------------------
# pictures


GRID_PROMPTS = 6  # toy image prompts drawn before and after RL for out_dir/images.png


def image_snapshot(model, tok, sp, cfg, device) -> list | None:
    """Toy images for the first GRID_PROMPTS held-out prompts, each from its own fixed generator, so the
    before and after pictures differ only by the policy. None without the toy image task."""
    if "image" not in task_list(cfg):
        return None
    exs = eval_examples("image", cfg, {})[:GRID_PROMPTS]
    if not exs:
        return None
    b = make_batch("image", exs, tok, sp, cfg, device, with_targets=False)
    gens = [generator(device, cfg.seed, "grid", i) for i in range(len(exs))]
    return decode_window(rollout(model, b, sp, cfg, gens, cfg.temperature)[0], tok, sp)


def write_pictures(cfg, out: Path, grid: list) -> None:
    """out_dir/curves.png (reward, KL, clip fraction per step) and out_dir/images.png (toy images before
    and after RL, prompt under each), when Pillow is installed (plots.py says how to get it otherwise)."""
    from infra import plots

    if (out / "log.jsonl").is_file() and (out / "log.jsonl").stat().st_size:
        plots.plot_curves(out / "log.jsonl", out / "curves.png")
    if grid[0][1] is not None and grid[1][1] is not None:
        prompts = [ex["prompt"] for ex in eval_examples("image", cfg, {})[:GRID_PROMPTS]]
        plots.image_grid(grid, prompts, cfg.image_width, out / "images.png")
