"""Toy tasks for the laptop preset: one vocabulary, two modalities, one small masked diffusion model.

Text: procedurally generated arithmetic word problems answered as written-out steps and a final
`\\boxed{N}` that a GSM8K-style reward reads (MaskGRPO arXiv:2510.02880 §4.1 trains on GSM8K).
Image: text-to-image on a tiny grid where every cell is one image token whose code is a palette colour,
scored by a GenEval-style verifier (colour, count, relative position), the role GenEval/UnifiedReward
play for MMaDA in the paper. Sequences follow the LLaDA (arXiv:2502.09992) and MMaDA (arXiv:2505.15809)
layouts, with their special-token names:

    text   <|startoftext|> question | answer <|endoftext|>...   (completion padded with EOS, as LLaDA SFT)
    image  [iPAD]... <|t2i|> <|startoftext|> caption <|endoftext|> <|soi|> image codes <|eoi|>

Everything here is pure Python seeded by `random.Random` (no torch), so tasks and rewards are testable
alone. `noise` makes a controlled fraction of SFT targets carry one *systematic* mistake: the boxed
answer copied from the wrong number of the (correct) working, or one named colour drawn as its
look-alike colour. The SFT model then becomes a mixture of a right and a wrong habit, the situation RL
is good at fixing (shift probability toward the habit that earns reward) and the one the toy is meant
to show in minutes. Random mistakes (wrong arithmetic, stray cells) were measured to mostly slow SFT
down and to leave errors that a few minutes of RL cannot repair. This is a deliberate property of the
toy, not of the paper; held-out evaluation always scores against the *true* answer/spec.
"""
from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

import rewards
from infra.rng import derive_seed

GRID_PROMPTS = 6  # toy image prompts drawn before and after RL for out_dir/images.png


def task_list(cfg) -> list[str]:
    return [t for t in cfg.tasks.split(",") if t]


def sft_tasks(cfg) -> tuple[str, ...]:
    """The toy tasks the SFT stage trains: those the run asks for (a text-only run spends no SFT on images)."""
    return tuple(t for t in TOY_TASKS if t in task_list(cfg))

# -----------------------------------------------------------------------------------------------------
# vocabulary

@dataclass(frozen=True)
class TokenIds:
    """The special-token ids a masked diffusion model reads and writes, resolved once by name from the
    tokenizer and config (tasks.token_ids for the toy vocabulary, infra/hf.token_ids for a released
    checkpoint), so that no id literal appears anywhere else. The MMaDA image fields are None for a
    text-only checkpoint (LLaDA); only the image tasks read them."""
    bos: int | None
    eos: int
    pad: int                      # LLaDA left-pads with the EOS id
    mask: int                     # the absorbing state m of the diffusion process
    vocab_size: int               # embedding rows: text tokenizer + image codebook
    t2i: int | None = None        # MMaDA text-to-image task marker
    soi: int | None = None        # start / end of the image slots
    eoi: int | None = None
    ipad: int | None = None       # MMaDA's caption padding
    image_token_offset: int | None = None  # image code c is token id image_token_offset + c
    codebook_size: int | None = None


def chat_prompt(messages: list[dict], bos: str = "<|startoftext|>") -> str:
    """LLaDA-Instruct chat template as a string. Encode the result with
    add_special_tokens=False; the special-token strings inside map to their ids.

    chat_prompt([{"role": "user", "content": "Q"}]) ==
    "<|startoftext|><|start_header_id|>user<|end_header_id|>\\n\\nQ<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\\n\\n"
    """
    turns = [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
             for m in messages]
    # The template has no add_generation_prompt switch: it always opens the assistant turn.
    return bos + "".join(turns) + "<|start_header_id|>assistant<|end_header_id|>\n\n"



# LLaDA/MMaDA special-token names (their released tokenizers). EOS doubles as pad, as in LLaDA-Instruct.
BOS, EOS, MASK = "<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>"
T2I, SOI, EOI, IPAD = "<|t2i|>", "<|soi|>", "<|eoi|>", "[iPAD]"
UNK = "[UNK]"  # WordLevel needs one; no generated text ever maps to it (tested)
SPECIAL_TOKENS = [BOS, EOS, UNK, T2I, SOI, EOI, IPAD, MASK]

NAMES = {"ann": "she", "sue": "she", "eve": "she", "amy": "she", "bob": "he", "tom": "he", "max": "he",
         "sam": "he"}
OBJECTS = ["apples", "pens", "books", "cards", "coins", "eggs", "shells", "stamps"]
ADD_VERBS = ["buys {} more", "finds {} more", "gets {} more"]     # each step: x + n
SUB_VERBS = ["gives {} away", "loses {}", "sells {}"]            # each step: x - n

# Palette: code 0 is background; code c >= 1 is COLOURS[c - 1]. ANSI 256-colour index for render_image.
COLOURS = ["red", "green", "blue", "yellow", "purple", "cyan", "white"]
ANSI = [236, 196, 46, 27, 226, 129, 51, 231]
CODEBOOK_SIZE = 1 + len(COLOURS)
COUNT_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
RELATIONS = {"left of": (1, -1), "right of": (1, 1), "above": (0, -1), "below": (0, 1)}  # (axis, sign)
PLACES = {"top row": (0, "first"), "bottom row": (0, "last"), "left column": (1, "first"),
          "right column": (1, "last")}

WORDS = sorted(set(NAMES) | set(NAMES.values()) | set(OBJECTS) | set(COLOURS) | set(COUNT_WORDS.values())
               | {w for v in ADD_VERBS + SUB_VERBS for w in v.split() if w != "{}"}
               | {w for k in list(RELATIONS) + list(PLACES) for w in k.split()}
               | {"has", "and", "how", "many", "does", "have", "block", "blocks", "in", "the"})
SYMBOLS = [".", ",", "?", "+", "-", "="]
BOXED = "\\boxed{"

# Pre-tokenization: Metaspace turns each space into "▁" glued to the next word (and prepends one at the
# start), then the regex isolates `\boxed{`, words, single digits, and single symbols, each optionally
# led by "▁". Single-digit tokens keep the vocabulary tiny and make numbers compositional; the
# Metaspace decoder maps "▁" back to spaces and drops the leading one, so decode(encode(s)) == s.
_PIECE = r"▁?(?:\\boxed\{|[a-z]+|[0-9]|[^▁a-z0-9])"


def build_tokenizer() -> Tokenizer:
    """The toy word-level tokenizer: special tokens, then text pieces; image codes are NOT tokens of
    the text tokenizer but ids appended after it (MMaDA: code c <-> id len(text_tokenizer) + c).

        tok = build_tokenizer()
        tok.encode("ann has 3 apples").tokens == ["▁ann", "▁has", "▁3", "▁apples"]
        tok.decode(tok.encode("5 . \\\\boxed{5}").ids) == "5 . \\\\boxed{5}"
    """
    pieces = [f"▁{w}" for w in WORDS] + [f"▁{s}" for s in SYMBOLS] + [f"▁{BOXED}", "}"]
    pieces += [d for d in "0123456789"] + [f"▁{d}" for d in "0123456789"]
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + pieces)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        pre_tokenizers.Split(Regex(_PIECE), behavior="isolated"),
    ])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    # Marking them special makes decode(..., skip_special_tokens=True) drop EOS padding and masks.
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def token_ids(tok: Tokenizer) -> TokenIds:
    """The toy vocabulary's special ids, looked up by name."""
    def tid(s):
        i = tok.token_to_id(s)
        if i is None:
            raise ValueError(f"tokenizer has no {s!r}; build it with tasks.build_tokenizer()")
        return i
    offset = tok.get_vocab_size(with_added_tokens=True)  # MMaDA: codes start at len(text tokenizer)
    return TokenIds(bos=tid(BOS), eos=tid(EOS), pad=tid(EOS), mask=tid(MASK), t2i=tid(T2I), soi=tid(SOI),
                    eoi=tid(EOI), ipad=tid(IPAD), image_token_offset=offset, codebook_size=CODEBOOK_SIZE,
                    vocab_size=offset + CODEBOOK_SIZE)


def model_config_overrides(tok: Tokenizer) -> dict:
    """The vocabulary fields of model.ModelConfig: `ModelConfig(d_model=..., **model_config_overrides(tok))`."""
    s = token_ids(tok)
    return dict(vocab_size=s.vocab_size, mask_token_id=s.mask, eos_token_id=s.eos, pad_token_id=s.pad,
                bos_token_id=s.bos, image_token_offset=s.image_token_offset, codebook_size=s.codebook_size)


def split_of(prompt: str, test_fraction: float = 0.2) -> str:
    """Deterministic train/test assignment by prompt hash, so held-out prompts are never trained on."""
    h = int.from_bytes(hashlib.sha1(prompt.encode()).digest()[:8], "big") / 2**64
    return "test" if h < test_fraction else "train"


def _draw(rng: random.Random, make, split: str):
    # Rejection-sample until the prompt lands in the requested split (~1.25 draws for train).
    if split not in ("train", "test", "any"):
        raise ValueError(f"split must be 'train', 'test' or 'any', got {split!r}")
    while True:
        ex = make()
        if split == "any" or split_of(ex["prompt"]) == split:
            return ex


# -----------------------------------------------------------------------------------------------------
# text task: arithmetic word problems with a \boxed{} answer


def make_text_example(rng: random.Random, split: str = "train", noise: float = 0.0, max_value: int = 9,
                      max_steps: int = 2) -> dict:
    """One word problem with max_steps - 1 or max_steps add/subtract steps (at least one, so the default
    toy's max_steps 1 and 2 give 1 and 1..2); every intermediate value in [0, max_value]. Each step is
    written out as `a + n = r` (5 tokens with one-digit values), so max_steps 4 gives completions of 21 or
    27 tokens, which the `toy_long` preset in train.py decodes in several semi-autoregressive blocks.

    With probability `noise` the completion is the systematic wrong target of `_wrong_target` (SFT data
    only): right working, box holding the amount before the last step. `answer` is always the true result
    and `solution` the right completion, which `solution_reward` compares with.

        make_text_example(random.Random(0)) -> {
          "prompt": "sue has 1 shells . she loses 1 and gets 6 more . how many shells does she have ?",
          "completion": "1 - 1 = 0 , 0 + 6 = 6 . \\\\boxed{6}", "answer": "6",
          "solution": "1 - 1 = 0 , 0 + 6 = 6 . \\\\boxed{6}"}
    """
    def make():
        name, obj = rng.choice(sorted(NAMES)), rng.choice(OBJECTS)
        x = rng.randint(1, max_value)
        clauses, steps = [], []  # steps: (left, op, n, result)
        for _ in range(rng.randint(max(1, max_steps - 1), max_steps)):
            ops = [o for o in "+-" if (o == "+" and x < max_value) or (o == "-" and x > 0)]
            op = rng.choice(ops)
            n = rng.randint(1, max_value - x) if op == "+" else rng.randint(1, x)
            clauses.append(rng.choice(ADD_VERBS if op == "+" else SUB_VERBS).format(n))
            steps.append((x, op, n, x + n if op == "+" else x - n))
            x = steps[-1][3]
        actions = " and ".join([" , ".join(clauses[:-1]), clauses[-1]] if len(clauses) > 1 else clauses)
        prompt = (f"{name} has {steps[0][0]} {obj} . {NAMES[name]} {actions} . "
                  f"how many {obj} does {NAMES[name]} have ?")
        return dict(prompt=prompt, steps=steps, answer=str(x))

    ex = _draw(rng, make, split)
    steps = ex.pop("steps")
    ex["solution"] = _written(steps, steps[-1][3])
    ex["completion"] = _written(*_wrong_target(rng, steps, max_value)) if rng.random() < noise else ex["solution"]
    return ex


def _written(steps: list, boxed: int) -> str:
    work = " , ".join(f"{a} {op} {n} = {r}" for a, op, n, r in steps)
    return f"{work} . {BOXED}{boxed}}}"


def _wrong_target(rng: random.Random, steps: list, max_value: int) -> tuple[list, int]:
    # The systematic mistake -> (steps written, boxed value): right working, but the box holds the amount
    # *before* the last step (for one step: the starting amount), as if the last action were forgotten.
    # Same tokens and length as a right target; only the box digit differs, so the SFT model learns
    # "copy the result" and "copy the last step's first number" as two habits. It is never the answer
    # (every step moves the amount by n >= 1), and no small shift of a working digit makes it one.
    # Why not "box = result + 1": measured on the default toy (seed 0, 512 sampled held-out completions),
    # RL cut that habit from 168 to 42 but also learned to write the working's result one *less* than the
    # truth so that "result + 1" landed on the answer; wrong working rose from 49 to 185, greedy accuracy
    # fell, and text gains were +0.06 to +0.13 across seeds and CPUs. With this target (and 80 RL steps)
    # seeds 0-4 gained +0.16 to +0.25 (docs/results.md).
    return steps, steps[-1][0]


_BOX = re.compile(r"\\boxed\{([^{}]*)\}")


def answer_reward(completion_text: str, example: dict) -> float:
    """1.0 if the last \\boxed{} in the decoded completion holds the true answer, else 0.0 (no format
    credit: the toy's SFT model always writes a box, so a format term would only add a constant).

        answer_reward("3 + 4 = 7 . \\\\boxed{7}", {"answer": "7"}) == 1.0
        answer_reward("3 + 4 = 8 . \\\\boxed{8}", {"answer": "7"}) == 0.0
        answer_reward("3 + 4 = 7", {"answer": "7"}) == 0.0      # no box
    """
    boxes = _BOX.findall(completion_text)
    return float(bool(boxes) and boxes[-1].strip() == example["answer"])


def solution_reward(completion_text: str, example: dict) -> float:
    """1.0 if the completion is the whole right solution, every step of the working as the problem states
    it and the box holding the answer, else 0.0 (the long toy's verifier, --text_reward=solution).

    Why the long toy checks the working: with 3-4 written-out steps and the box-only `text_reward`, RL runs
    lost right working (greedy accuracy fell on most seeds; docs/results.md), as no reward term read those
    tokens. The working of these problems is unique, so the check is an exact comparison.

        solution_reward("3 + 4 = 7 . \\\\boxed{7}", {"solution": "3 + 4 = 7 . \\\\boxed{7}"}) == 1.0
        solution_reward("3 + 4 = 6 . \\\\boxed{7}", {"solution": "3 + 4 = 7 . \\\\boxed{7}"}) == 0.0
    """
    return float(completion_text.strip() == example["solution"])


TEXT_REWARDS = {"answer": answer_reward, "solution": solution_reward}  # --text_reward


def encode_text(tok: Tokenizer, example: dict, gen_length: int) -> tuple[list[int], list[int]]:
    """(prompt_ids, completion_ids): prompt = BOS + question; completion = answer + EOS padding to
    exactly gen_length tokens (LLaDA SFT pads answers with EOS, so the model learns where to stop).
    Batch prompts by left-padding with token_ids(tok).pad and attention 0 on the pads (sample.generate)."""
    s = token_ids(tok)
    prompt = [s.bos] + tok.encode(example["prompt"], add_special_tokens=False).ids
    answer = tok.encode(example["completion"], add_special_tokens=False).ids
    if len(answer) >= gen_length:
        raise ValueError(f"completion needs {len(answer)} tokens + 1 EOS but gen_length is {gen_length}; "
                         "raise gen_length or lower max_steps/max_value")
    return prompt, answer + [s.eos] * (gen_length - len(answer))


def make_image_example(rng: random.Random, split: str = "train", noise: float = 0.0, width: int = 4) -> dict:
    """One caption, its checkable spec, and one valid target grid (row-major codes, 0 = background).

    Categories as in GenEval: single object, counting, two objects, relative position, and placement
    ("in the top row"). Every object is one cell of its colour, so "count" is a number of cells.
    With probability `noise` the target grid breaks one check (SFT data only).

        make_image_example(random.Random(1)) -> {"prompt": "three purple blocks",
          "spec": {"width": 4, "counts": {"purple": 3}, "relation": None, "place": None},
          "image": [0, 0, 0, 5, 0, 0, 0, 5, 0, 0, 0, 0, 5, 0, 0, 0]}
    """
    def make():
        kind = rng.choice(["single", "count", "two", "relation", "place"])
        a, b = rng.sample(COLOURS, 2)
        spec = {"width": width, "counts": {a: 1}, "relation": None, "place": None}
        if kind == "single":
            prompt = f"a {a} block"
        elif kind == "count":
            n = rng.randint(2, len(COUNT_WORDS))
            spec["counts"] = {a: n}
            prompt = f"{COUNT_WORDS[n]} {a} blocks"
        elif kind == "two":
            spec["counts"] = {a: 1, b: 1}
            prompt = f"a {a} block and a {b} block"
        elif kind == "relation":
            rel = rng.choice(sorted(RELATIONS))
            spec["counts"], spec["relation"] = {a: 1, b: 1}, [a, rel, b]
            prompt = f"a {a} block {rel} a {b} block"
        else:
            place = rng.choice(sorted(PLACES))
            spec["place"] = [a, place]
            prompt = f"a {a} block in the {place}"
        return dict(prompt=prompt, spec=spec)

    ex = _draw(rng, make, split)
    spec = ex["spec"]
    cells = width * width
    while True:  # rejection-sample a grid that satisfies every check (a handful of tries at most)
        image = [0] * cells
        free = rng.sample(range(cells), sum(spec["counts"].values()))
        k = 0
        for c, n in spec["counts"].items():
            for _ in range(n):
                image[free[k]] = COLOURS.index(c) + 1
                k += 1
        if image_reward(image, spec) == 1.0:
            break
    if rng.random() < noise:
        image = _corrupt(rng, image, spec)
    ex["image"] = image
    return ex


def _corrupt(rng: random.Random, image: list[int], spec: dict) -> list[int]:
    # The systematic mistake: every cell of the first named colour drawn in its look-alike (the next
    # palette colour), which always breaks that colour's count check. Layout is untouched.
    c = COLOURS.index(next(iter(spec["counts"]))) + 1
    look_alike = c % len(COLOURS) + 1
    return [look_alike if x == c else x for x in image]


def image_checks(codes: list[int], spec: dict) -> list[bool]:
    """The verifier's individual checks: for each named colour its exact cell count; the relation or
    placement if any; and "no stray colours" (the set of colours present equals the named set)."""
    w = spec["width"]
    cells = {c: [divmod(i, w) for i, x in enumerate(codes) if x == COLOURS.index(c) + 1] for c in COLOURS}
    checks = [len(cells[c]) == n for c, n in spec["counts"].items()]
    present = {c for c in COLOURS if cells[c]}
    checks.append(present == set(spec["counts"]))
    if spec["relation"]:
        a, rel, b = spec["relation"]
        axis, sign = RELATIONS[rel]
        # Every cell of a strictly on the named side of every cell of b (GenEval compares box centres;
        # with one-cell objects this is the same thing).
        checks.append(bool(cells[a]) and bool(cells[b]) and
                      all(sign * (q[axis] - p[axis]) > 0 for p in cells[b] for q in cells[a]))
    if spec["place"]:
        a, place = spec["place"]
        axis, end = PLACES[place]
        line = 0 if end == "first" else w - 1
        checks.append(bool(cells[a]) and all(p[axis] == line for p in cells[a]))
    return checks


def image_reward(codes: list[int], spec: dict) -> float:
    """Fraction of satisfied checks in [0, 1] (GenEval itself is all-or-nothing per prompt; a fraction
    gives RL a denser signal).

        spec = {"width": 2, "counts": {"red": 1}, "relation": None, "place": None}
        image_reward([1, 0, 0, 0], spec) == 1.0     # one red cell, nothing else
        image_reward([1, 1, 0, 0], spec) == 0.5     # two reds: count wrong, colours right
        image_reward([0, 0, 0, 0], spec) == 0.0     # empty grid
    """
    if len(codes) != spec["width"] ** 2:
        return 0.0
    checks = image_checks(codes, spec)
    return sum(checks) / len(checks)


def encode_image_prompt(tok: Tokenizer, prompt_text: str, text_len: int, num_tokens: int,
                        ids: TokenIds | None = None) -> tuple[list[int], int, list[int]]:
    """MMaDA t2i layout (arXiv:2505.15809): [iPAD]*pad <|t2i|> BOS caption EOS <|soi|> mask*num_tokens
    <|eoi|>. The text part is left-padded with [iPAD] to exactly text_len tokens (truncated and
    re-terminated with EOS if longer). prompt_text "" gives the unconditional prompt used for CFG.
    Returns (input_ids, image_start, attention_mask) with attention 0 on the [iPAD] positions; the
    image slots are input_ids[image_start : image_start + num_tokens]. ids: the token ids (default: the toy
    tokenizer's, by name; infra/hf.token_ids gives a released checkpoint's)."""
    s = ids or token_ids(tok)
    if None in (s.t2i, s.soi, s.eoi, s.ipad):
        raise ValueError("the tokenizer lacks MMaDA's <|t2i|> / <|soi|> / <|eoi|> / [iPAD] tokens: text-to-image "
                         "needs an MMaDA checkpoint (its tokenizer.json), not a text-only LLaDA one")
    text = [s.t2i, s.bos] + tok.encode(prompt_text, add_special_tokens=False).ids + [s.eos]
    if len(text) > text_len:
        text = text[:text_len - 1] + [s.eos]
    pad = text_len - len(text)
    ids = [s.ipad] * pad + text + [s.soi] + [s.mask] * num_tokens + [s.eoi]
    return ids, text_len + 1, [0] * pad + [1] * (len(ids) - pad)


def image_text_len(tok: Tokenizer, n: int = 2000) -> int:
    """Longest t2i text part (<|t2i|> BOS caption EOS) over n random captions: the text_len to pad to."""
    rng = random.Random(0)
    return 3 + max(len(tok.encode(make_image_example(rng, "any")["prompt"], add_special_tokens=False).ids)
                   for _ in range(n))


def ids_to_codes(tok: Tokenizer, ids: list[int]) -> list[int]:
    """Image codes of token ids (code c is id image_token_offset + c); any id outside the image range (a
    leftover mask, say) becomes -1."""
    s = token_ids(tok)
    return [i - s.image_token_offset if 0 <= i - s.image_token_offset < s.codebook_size else -1 for i in ids]


def render_image(codes: list[int], width: int) -> str:
    """The grid as ANSI 256-colour blocks, one row per line ('??' for an invalid code)."""
    rows = []
    for r in range(0, len(codes), width):
        rows.append("".join(f"\x1b[48;5;{ANSI[c]}m  \x1b[0m" if 0 <= c < len(ANSI) else "??"
                            for c in codes[r:r + width]))
    return "\n".join(rows)


# -----------------------------------------------------------------------------------------------------
# the tasks: one registry entry each


@dataclass(frozen=True)
class Task:
    """One RL task: its modality, where its prompts come from, and its reward."""
    modality: str                   # "text" or "image": the sampler, the reversing operator, the scored vocabulary
    reward: object = None           # reward(completion, example) -> [0, 1]; None: the remote image scorer
    shaped: object = None           # --reward_shaping=official: the official runs' format + correctness reward
    example: object = None          # toy tasks: example(rng, cfg, split, noise) -> a fresh example (make_example);
                                    # None: the prompts are read from --train_data (infra/data.py)

    @property
    def toy(self) -> bool:
        return self.example is not None


TASKS = {
    "text": Task("text", answer_reward,  # --text_reward picks among TEXT_REWARDS
                 example=lambda rng, cfg, split, noise: make_text_example(rng, split, noise, max_steps=cfg.text_max_steps)),
    "image": Task("image", lambda codes, example: image_reward(codes, example["spec"]),
                  example=lambda rng, cfg, split, noise: make_image_example(rng, split, noise, width=cfg.image_width)),
    "gsm8k": Task("text", rewards.REWARDS["gsm8k"], rewards.SHAPED["gsm8k"]),
    "math": Task("text", rewards.REWARDS["math"], rewards.SHAPED["math"]),
    "mbpp": Task("text", rewards.REWARDS["mbpp"]),
    "countdown": Task("text", rewards.REWARDS["countdown"]),
    "sudoku": Task("text", rewards.REWARDS["sudoku"]),
    "geneval": Task("image"),
}
TOY_TASKS = tuple(t for t, k in TASKS.items() if k.toy)
IMAGE_TASKS = tuple(t for t, k in TASKS.items() if k.modality == "image")  # generated as image tokens


def score(b, tok, ids, scorer=None, shaping: str = "none", text_reward: str = "answer") -> torch.Tensor:
    """Step 2 of the RL loop: a reward in [0, 1] per row of Batch b, from its task's entry in TASKS (the toy
    text task's from TEXT_REWARDS[text_reward]; with shaping="official", the shaped one where the task has
    it), or for geneval images from the remote scorer."""
    task, outs = TASKS[b.task], decode_window(b, tok, ids)
    if task.reward is None:
        try:
            return torch.tensor(scorer([ex["prompt"] for ex in b.examples], outs), dtype=torch.float32)
        except (ValueError, OSError, RuntimeError) as e:
            # Down, refusing, or replying NaN: NaN rewards, which train.rl_step's gathered check turns into a
            # skipped step on every rank (a rank that raised alone would leave the others waiting).
            print(f"warning: image scorer failed ({e}); this batch gets NaN rewards", flush=True)
            return torch.full((len(outs),), math.nan)
    fn = TEXT_REWARDS[text_reward] if b.task == "text" else \
        task.shaped if shaping == "official" and task.shaped else task.reward
    return torch.tensor([fn(o, ex) for o, ex in zip(outs, b.examples)], dtype=torch.float32)


# -----------------------------------------------------------------------------------------------------
# batches: examples of any task -> token tensors [prompt | window | suffix]


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
    index: list | None = None       # each row's index in the global batch (seeds its randomness); None = 0..B-1

    @property
    def prompt_mask(self):          # (B, P) real prompt tokens (never masked by the MaskGRPO estimator)
        return self.attention_mask[:, : self.prompt_len].bool()

    @property
    def window_slice(self):
        return slice(self.prompt_len, self.prompt_len + self.window)

    def rows(self, rows: slice) -> "Batch":
        """This rank's rows of a global batch (same padding as every other rank's), with their global index."""
        pick = lambda t: None if t is None else t[rows]
        index = list(range(self.x.shape[0])) if self.index is None else self.index
        return Batch(self.task, self.x[rows], self.attention_mask[rows], self.prompt_len, self.window,
                     pick(self.uncond), pick(self.uncond_mask), self.examples[rows], index[rows])


def make_batch(task: str, examples: list, tok, ids, cfg, device, with_targets: bool) -> Batch:
    """Token tensors for `examples`; the window holds the target (SFT) or mask ids (rollout prompts).
    Text prompts are left-padded to the longest in `examples`: build the *global* batch on every rank and
    take rows from it (Batch.rows), so that a sequence's padding, and hence its logits, do not depend on
    the world size."""
    if task in IMAGE_TASKS:
        return _image_batch(task, examples, tok, ids, cfg, device, with_targets)
    if TASKS[task].toy:  # a toy text task: BOS + question, the answer padded with EOS (encode_text)
        pairs = [encode_text(tok, ex, cfg.gen_length) for ex in examples]
    else:  # a benchmark prompt in the LLaDA chat template, cut from the left like the official code
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        pairs = [(tok.encode(chat_prompt(system + [{"role": "user", "content": ex["prompt"]}]) + cfg.prompt_prefill,
                             add_special_tokens=False).ids[-cfg.max_prompt_len:], None) for ex in examples]
    P = max(len(p) for p, _ in pairs)
    rows, att = [], []
    for p, c in pairs:
        pad = P - len(p)
        window = c if with_targets else [ids.mask] * cfg.gen_length
        rows.append([ids.pad] * pad + p + window)  # LLaDA left-pads prompts with EOS
        att.append([0] * pad + [1] * (len(p) + cfg.gen_length))
    x = torch.tensor(rows, device=device)
    att = torch.tensor(att, device=device)
    return Batch(task, x, att.fill_(1) if attends_padding(cfg, task) else att, P, cfg.gen_length, examples=examples)


def attends_padding(cfg, task: str) -> bool:
    """Config.attend_padding resolved for a task. "auto" is on for geneval, the MMaDA-checkpoint image task:
    MMaDA's official modelling code calls attention with attn_mask=None, so its checkpoints saw their [iPAD]
    padding. It is off for text (the official text runs have no padding: one prompt group per GPU) and for the
    toy image task, whose model is trained here, with pad keys masked. On, a batch's attention mask is all
    ones, which model.forward treats as no mask."""
    return cfg.attend_padding == "on" or (cfg.attend_padding == "auto" and task == "geneval")


def _image_batch(task, examples, tok, ids, cfg, device, with_targets: bool) -> Batch:
    """MMaDA's t2i layout (tasks.encode_image_prompt), with the empty-caption prompt for CFG."""
    n = cfg.image_width ** 2
    text_len = cfg.image_text_len or caption_len(tok)
    enc = [encode_image_prompt(tok, ex["prompt"], text_len, n, ids) for ex in examples]
    unc = encode_image_prompt(tok, "", text_len, n, ids)
    x = torch.tensor([e[0] for e in enc], device=device)
    att = torch.tensor([e[2] for e in enc], device=device)
    start = enc[0][1]
    if with_targets:
        x[:, start:start + n] = torch.tensor([ex["image"] for ex in examples], device=device) + ids.image_token_offset
    B = len(examples)
    uncond = torch.tensor(unc[0], device=device).expand(B, -1).clone()
    uncond_mask = torch.tensor(unc[2], device=device).expand(B, -1).clone()
    if attends_padding(cfg, task):  # conditional and CFG's unconditional passes alike
        att, uncond_mask = att.fill_(1), uncond_mask.fill_(1)
    return Batch(task, x, att, start, n, uncond, uncond_mask, examples)


def make_example(task: str, rng: random.Random, cfg, split: str, noise: float = 0.0) -> dict:
    """A fresh example of toy task `task` (its TASKS entry's generator), in `split`."""
    return TASKS[task].example(rng, cfg, split, noise)


_TEXT_LEN: dict = {}


def caption_len(tok) -> int:
    """Caption part of every t2i prompt, padded to the longest toy caption (computed once per vocabulary)."""
    key = tok.get_vocab_size(with_added_tokens=True)
    if key not in _TEXT_LEN:
        _TEXT_LEN[key] = image_text_len(tok)
    return _TEXT_LEN[key]


def vocab_slice(task: str, ids):
    """Image positions are scored over the image-code columns only (MMaDA arXiv:2505.15809: the image head predicts codes)."""
    return (ids.image_token_offset, ids.image_token_offset + ids.codebook_size) if task in IMAGE_TASKS else None


def decode_window(b: Batch, tok, ids) -> list:
    """Completion text (text tasks) or image codes (image tasks) per row."""
    w = b.x[:, b.window_slice].tolist()
    if b.task not in IMAGE_TASKS:
        return [tok.decode(row, skip_special_tokens=True) for row in w]
    return [[c - ids.image_token_offset for c in row] for row in w]


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


def eval_examples(task: str, cfg, datasets: dict) -> list:
    """The held-out prompts: fixed toy draws from the test split, or the first eval_prompts of eval_data."""
    if task in TOY_TASKS:
        rng = random.Random(derive_seed(cfg.seed, "eval", task))
        return [make_example(task, rng, cfg, "test") for _ in range(cfg.eval_prompts)]
    return datasets.get(task, {}).get("test", [])[: cfg.eval_prompts]
