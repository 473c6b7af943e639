"""The tasks (TASKS: modality, prompts, verifiers), the batches they become ([prompt | window | suffix] in the
LLaDA (arXiv:2502.09992) and MMaDA (arXiv:2505.15809) formats, the window generated), and the RL step's prompts
and rewards. The toy data is infra/toy.py, the verifiers rewards.py, benchmark files infra/data.py.
"""
import random
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

import rewards
from infra import scale
from sample import derive_seed
from infra.toy import BOS, CODEBOOK_SIZE, EOI, EOS, IPAD, MASK, SOI, T2I, make_image_example, make_text_example

TOY_CAPTION_LEN = 11  # --image_text_len=0: the toy's longest <|t2i|> BOS caption EOS (image_text_len)


def task_list(cfg) -> list[str]:
    return [t for t in cfg.tasks.split(",") if t]


def sft_tasks(cfg) -> tuple[str, ...]:
    """The toy tasks the SFT stage trains: those the run asks for."""
    return tuple(t for t in TOY_TASKS if t in task_list(cfg))

# --- vocabulary

@dataclass(frozen=True)
class TokenIds:
    """Special-token ids, looked up by name once (token_ids; infra/hf.token_ids): no id literals."""
    bos: int | None
    eos: int
    pad: int  # LLaDA left-pads with the EOS id
    mask: int  # the absorbing state m of the diffusion process
    vocab_size: int  # embedding rows: text tokenizer + image codebook
    t2i: int | None = None  # MMaDA text-to-image marker (image fields: None for LLaDA)
    soi: int | None = None  # start / end of the image slots
    eoi: int | None = None
    ipad: int | None = None  # MMaDA's caption padding
    image_token_offset: int | None = None  # image code c is token id image_token_offset + c
    codebook_size: int | None = None


def chat_prompt(messages: list[dict], bos: str = "<|startoftext|>") -> str:
    """LLaDA-Instruct's chat template, the assistant turn opened; encode it with add_special_tokens=False."""
    turns = [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
             for m in messages]
    return bos + "".join(turns) + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def token_ids(tok: Tokenizer) -> TokenIds:
    """The toy vocabulary's special ids, looked up by name."""
    def tid(s):
        i = tok.token_to_id(s)
        if i is None:
            raise ValueError(f"tokenizer has no {s!r}; build it with infra.toy.build_tokenizer()")
        return i
    offset = tok.get_vocab_size(with_added_tokens=True)  # MMaDA: codes start at len(text tokenizer)
    return TokenIds(bos=tid(BOS), eos=tid(EOS), pad=tid(EOS), mask=tid(MASK), t2i=tid(T2I), soi=tid(SOI),
                    eoi=tid(EOI), ipad=tid(IPAD), image_token_offset=offset, codebook_size=CODEBOOK_SIZE,
                    vocab_size=offset + CODEBOOK_SIZE)


def model_config_overrides(tok: Tokenizer) -> dict:
    """The vocabulary fields of model.ModelConfig: `ModelConfig(..., **model_config_overrides(tok))`."""
    s = token_ids(tok)
    return dict(vocab_size=s.vocab_size, mask_token_id=s.mask, eos_token_id=s.eos, pad_token_id=s.pad,
                bos_token_id=s.bos, image_token_offset=s.image_token_offset, codebook_size=s.codebook_size)


# --- encoding: examples -> token ids

def encode_text(tok: Tokenizer, ids: TokenIds, example: dict, gen_length: int) -> tuple[list[int], list[int]]:
    """(BOS + question, answer + EOS padding to gen_length): LLaDA's SFT pads with EOS."""
    prompt = [ids.bos] + tok.encode(example["prompt"], add_special_tokens=False).ids
    answer = tok.encode(example["completion"], add_special_tokens=False).ids
    if len(answer) >= gen_length:
        raise ValueError(f"completion needs {len(answer)} tokens + 1 EOS but gen_length is {gen_length}; "
                         "raise gen_length or lower max_steps/max_value")
    return prompt, answer + [ids.eos] * (gen_length - len(answer))


def encode_chat(tok: Tokenizer, example: dict, cfg) -> list[int]:
    """A benchmark prompt in LLaDA's chat template, left-cut to --max_prompt_len as the official code."""
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    text = chat_prompt(system + [{"role": "user", "content": example["prompt"]}]) + cfg.prompt_prefill
    return tok.encode(text, add_special_tokens=False).ids[-cfg.max_prompt_len:]

def encode_image_prompt(tok: Tokenizer, ids: TokenIds, prompt_text: str, text_len: int,
                        num_tokens: int) -> tuple[list[int], int, list[int]]:
    """MMaDA's t2i layout [iPAD]* <|t2i|> BOS caption EOS <|soi|> mask*num_tokens <|eoi|>: (ids, image start, mask)."""
    if None in (ids.t2i, ids.soi, ids.eoi, ids.ipad):
        raise ValueError("the tokenizer lacks MMaDA's <|t2i|>, <|soi|>, <|eoi|>, [iPAD]: images need an MMaDA one")
    text = [ids.t2i, ids.bos] + tok.encode(prompt_text, add_special_tokens=False).ids + [ids.eos]
    if len(text) > text_len:
        text = text[:text_len - 1] + [ids.eos]
    pad = text_len - len(text)
    x = [ids.ipad] * pad + text + [ids.soi] + [ids.mask] * num_tokens + [ids.eoi]
    return x, text_len + 1, [0] * pad + [1] * (len(x) - pad)


def image_text_len(tok: Tokenizer, n: int = 2000) -> int:
    """The text_len to pad to: the longest <|t2i|> BOS caption EOS over n random toy captions."""
    rng = random.Random(0)
    return 3 + max(len(tok.encode(make_image_example(rng, "any")["prompt"], add_special_tokens=False).ids)
                   for _ in range(n))


# --- the tasks: one registry entry each

@dataclass(frozen=True)
class Task:
    """One RL task: its modality, where its prompts come from, and its verifiers."""
    modality: str  # "text" or "image": the sampler, the reversing operator, the scored vocabulary
    reward: dict  # {name: verifier(completion, example) -> [0, 1]}; {}: the remote image scorer
    picked_by: str = ""  # the setting naming the verifier; "": the only one
    example: object = None  # toy: example(rng, cfg, split, noise) -> an example; None: read --train_data


TASKS = {
    "text": Task("text", {"answer": rewards.answer_reward, "solution": rewards.solution_reward}, "text_reward",
                 lambda rng, cfg, split, noise: make_text_example(rng, split, noise, max_steps=cfg.text_max_steps)),
    "image": Task("image", {"grid": rewards.image_reward},
                  example=lambda rng, cfg, split, noise: make_image_example(rng, split, noise, width=cfg.image_width)),
    # benchmarks: correctness ("none"), and the official runs' shaped reward if any ("official")
    **{name: Task("text", {"none": rewards.REWARDS[name], **({"official": rewards.SHAPED[name]}
                                                            if name in rewards.SHAPED else {})}, "reward_shaping")
       for name in ("gsm8k", "math", "mbpp", "countdown", "sudoku")},
    "geneval": Task("image", {}),
}
TOY_TASKS = tuple(t for t, k in TASKS.items() if k.example is not None)
IMAGE_TASKS = tuple(t for t, k in TASKS.items() if k.modality == "image")  # generated as image tokens
TEXT_REWARDS = tuple(TASKS["text"].reward)  # --text_reward's values


def verifier(task: str, text_reward: str = "answer", reward_shaping: str = "none"):
    """The rewards.py function scoring `task` that its setting names (geneval: None)."""
    t = TASKS[task]
    if not t.picked_by:  # the one verifier (more is an error, never a pick)
        (verify,) = t.reward.values() if t.reward else [None]
        return verify
    name = {"text_reward": text_reward, "reward_shaping": reward_shaping}[t.picked_by]
    if name not in t.reward:
        raise ValueError(f"--{t.picked_by}={name} names no verifier of task {task}: pass "
                         f"{' or '.join(f'--{t.picked_by}={k}' for k in t.reward)}, or drop {task} from --tasks")
    return t.reward[name]


def score(b, verify, tok, ids, scorer=None) -> torch.Tensor:
    """Step 2: a reward in [0, 1] per row of b: verify(completion, example), or the scorer's."""
    outs = decode_window(b, tok, ids)
    if verify is None:  # geneval: NaN rewards if the scorer fails, which skip the step on every rank
        return scorer.rewards([ex["prompt"] for ex in b.examples], outs)
    return torch.tensor([verify(o, ex) for o, ex in zip(outs, b.examples)], dtype=torch.float32)


# --- batches: examples -> token tensors

@dataclass
class Batch:
    """Sequences laid out as [prompt (P) | window (N) | suffix (S)]; the model generates the window."""
    task: str
    x: torch.Tensor  # (B, L) token ids; the window holds targets (SFT) or rollouts (RL)
    attention_mask: torch.Tensor  # (B, L) 1 = real token, 0 = left padding
    prompt_len: int  # P
    window: int  # N
    uncond: torch.Tensor | None = None  # (B, L) unconditional prompt for CFG (image)
    uncond_mask: torch.Tensor | None = None  # (B, L)
    examples: list | None = None
    index: list | None = None  # each row's global index (seeds its randomness); None = 0..B-1
    vocab_slice: tuple | None = None  # (lo, hi): image positions scored over the code columns only (MMaDA)

    @property
    def prompt_mask(self):  # (B, P) real prompt tokens (never masked by the MaskGRPO estimator)
        return self.attention_mask[:, : self.prompt_len].bool()

    @property
    def window_slice(self):
        return slice(self.prompt_len, self.prompt_len + self.window)

    def rows(self, rows: slice) -> "Batch":
        """Some rows (this rank's, or a chunk), with their global index."""
        pick = lambda t: None if t is None else t[rows]
        index = list(range(self.x.shape[0])) if self.index is None else self.index
        return Batch(self.task, self.x[rows], self.attention_mask[rows], self.prompt_len, self.window,
                     pick(self.uncond), pick(self.uncond_mask), self.examples[rows], index[rows], self.vocab_slice)


def make_batch(task: str, examples: list, tok, ids, cfg, device, with_targets: bool) -> Batch:
    """Token tensors for `examples`, the window holding the targets (SFT) or mask ids; text prompts left-padded."""
    if task in IMAGE_TASKS:
        return _image_batch(task, examples, tok, ids, cfg, device, with_targets)
    toy = task in TOY_TASKS  # toy: BOS + question, the answer padded with EOS; benchmarks: the chat template
    pairs = [encode_text(tok, ids, ex, cfg.gen_length) if toy else (encode_chat(tok, ex, cfg), None) for ex in examples]
    P, N = max(len(p) for p, _ in pairs), cfg.gen_length
    pad = torch.tensor([P - len(p) for p, _ in pairs], device=device)  # LLaDA left-pads prompts with EOS
    x = torch.tensor([[ids.pad] * (P - len(p)) + p + (c if with_targets else [ids.mask] * N) for p, c in pairs],
                     device=device)
    att = (torch.arange(P + N, device=device) >= pad[:, None]).long()  # (B, L) 0 on the padding
    return Batch(task, x, att.fill_(1) if attends_padding(cfg, task) else att, P, cfg.gen_length, examples=examples)


def attends_padding(cfg, task: str) -> bool:
    """--attend_padding for a task: "auto" is on for geneval only (MMaDA's checkpoints saw [iPAD] padding)."""
    return cfg.attend_padding == "on" or (cfg.attend_padding == "auto" and task == "geneval")


def _image_batch(task, examples, tok, ids, cfg, device, with_targets: bool) -> Batch:
    """MMaDA's t2i layout (encode_image_prompt), with the empty-caption prompt for CFG."""
    n, text_len, B = cfg.image_width ** 2, cfg.image_text_len or TOY_CAPTION_LEN, len(examples)
    enc = [encode_image_prompt(tok, ids, ex["prompt"], text_len, n) for ex in examples + [{"prompt": ""}]]
    x = torch.tensor([e[0] for e in enc], device=device)  # (B + 1, L): the last row is CFG's
    att = torch.tensor([e[2] for e in enc], device=device)  # (B + 1, L)
    att = att.fill_(1) if attends_padding(cfg, task) else att  # all ones: no mask (model.forward), both
    start = enc[0][1]
    if with_targets:
        x[:B, start:start + n] = torch.tensor([ex["image"] for ex in examples], device=device) + ids.image_token_offset
    return Batch(task, x[:B], att[:B], start, n, x[B:].expand(B, -1).clone(), att[B:].expand(B, -1).clone(), examples,
                 vocab_slice=(ids.image_token_offset, ids.image_token_offset + ids.codebook_size))


def make_example(task: str, rng: random.Random, cfg, split: str, noise: float = 0.0) -> dict:
    """A fresh example of toy task `task` (its TASKS entry's generator), in `split`."""
    return TASKS[task].example(rng, cfg, split, noise)


def decode_window(b: Batch, tok, ids) -> list:
    """Completion text or image codes per row."""
    w = b.x[:, b.window_slice].tolist()
    if b.task not in IMAGE_TASKS:
        return [tok.decode(row, skip_special_tokens=True) for row in w]
    return [[c - ids.image_token_offset for c in row] for row in w]


def draw_prompts(task: str, cfg, step: int, datasets: dict) -> list:
    """The global prompts of one RL step, the same on every rank: fresh toy examples seeded by the step."""
    if task not in TOY_TASKS:
        return dataset_prompts(task, cfg, step, datasets[task]["train"])
    rng = random.Random(derive_seed(cfg.seed, "rl-prompts", task, step))
    return [TASKS[task].example(rng, cfg, "train", 0.0) for _ in range(cfg.prompts_per_step)]


def dataset_prompts(task: str, cfg, step: int, rows: list) -> list:
    """Step `step`'s rows of a dataset, in a fresh seeded permutation per epoch: a resumed run sees the same ones."""
    out, first = [], step * cfg.prompts_per_step
    for i in range(first, first + cfg.prompts_per_step):
        if i == first or i % len(rows) == 0:  # one shuffle per epoch
            order = list(range(len(rows)))
            random.Random(derive_seed(cfg.seed, "epoch", task, i // len(rows))).shuffle(order)
        out.append(rows[order[i % len(rows)]])
    return out

# --- the RL step's prompts

@dataclass
class Ctx:
    """What the loop needs besides the model and the optimizer."""
    cfg: object  # the run's train.Config; a step reads only its StepConfig fields
    tok: object  # tokenizers.Tokenizer
    ids: TokenIds
    device: torch.device
    datasets: dict  # {task: {"train": rows, "test": rows}} (infra/data.load_data)
    scorer: object = None  # infra/sandbox.RemoteScorer for geneval rewards
    text_sampler: object = None  # RL text rollouts: None = sample.generate (or sample.FastSampler)


def step_prompts(ctx: Ctx, step: int) -> list[Batch]:
    """Step `step`'s prompts, one Batch per task, each G times: this rank's rows with their global index."""
    cfg, out = ctx.cfg, []
    for task in task_list(cfg):
        exs = [ex for ex in draw_prompts(task, cfg, step, ctx.datasets) for _ in range(cfg.group_size)]
        b = make_batch(task, exs, ctx.tok, ctx.ids, cfg, ctx.device, with_targets=False)
        out.append(b.rows(scale.shard_rows(len(exs))))  # this rank's whole groups
    return out
