"""The toy world of the laptop preset: one vocabulary, two modalities, their data (tasks.TASKS), in pure Python.
Text: word problems answered as written-out steps and a `\\boxed{N}` a GSM8K-style reward reads (arXiv:2510.02880
§4.1); image: a tiny grid of palette-colour tokens scored by a GenEval-style verifier (colour, count, position).
`noise` gives a fraction of SFT targets one *systematic* mistake, which RL fixes in minutes (random ones were
measured to leave errors it cannot); held-out evaluation scores the true target.
"""
import hashlib
import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from rewards import COLOURS, PLACES, RELATIONS, image_checks  # the grid the image verifier reads

# LLaDA/MMaDA special-token names (their released tokenizers). EOS doubles as pad, as in LLaDA-Instruct.
BOS, EOS, MASK = "<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>"
T2I, SOI, EOI, IPAD = "<|t2i|>", "<|soi|>", "<|eoi|>", "[iPAD]"
UNK = "[UNK]"  # WordLevel needs one; no generated text ever maps to it (tested)
SPECIAL_TOKENS = [BOS, EOS, UNK, T2I, SOI, EOI, IPAD, MASK]

NAMES = {"ann": "she", "sue": "she", "eve": "she", "amy": "she", "bob": "he", "tom": "he", "max": "he", "sam": "he"}
OBJECTS = ["apples", "pens", "books", "cards", "coins", "eggs", "shells", "stamps"]
ADD_VERBS = ["buys {} more", "finds {} more", "gets {} more"]     # each step: x + n
SUB_VERBS = ["gives {} away", "loses {}", "sells {}"]            # each step: x - n

ANSI = [236, 196, 46, 27, 226, 129, 51, 231]  # render_image's 256-colour index per code (rewards.COLOURS)
CODEBOOK_SIZE = 1 + len(COLOURS)
COUNT_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}

WORDS = sorted(set(NAMES) | set(NAMES.values()) | set(OBJECTS) | set(COLOURS) | set(COUNT_WORDS.values())
               | {w for v in ADD_VERBS + SUB_VERBS for w in v.split() if w != "{}"}
               | {w for k in list(RELATIONS) + list(PLACES) for w in k.split()}
               | {"has", "and", "how", "many", "does", "have", "block", "blocks", "in", "the"})
BOXED = "\\boxed{"

# Metaspace turns each space into "▁" glued to the next word (one is prepended), then the regex isolates `\boxed{`,
# words, single digits (a tiny vocabulary, compositional numbers) and single symbols, each optionally led by "▁".
_PIECE = r"▁?(?:\\boxed\{|[a-z]+|[0-9]|[^▁a-z0-9])"


def build_tokenizer() -> Tokenizer:
    """The toy word-level tokenizer (decode(encode(s)) == s): special tokens, then text pieces. Image codes are ids
    appended after it, not text tokens (MMaDA: code c <-> id len(text_tokenizer) + c)."""
    pieces = [f"▁{w}" for w in WORDS + [".", ",", "?", "+", "-", "="]] + [f"▁{BOXED}", "}"]
    pieces += list("0123456789") + [f"▁{d}" for d in "0123456789"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL_TOKENS + pieces)}, unk_token=UNK))
    metaspace = dict(replacement="▁", prepend_scheme="always", split=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(**metaspace),
                                                 pre_tokenizers.Split(Regex(_PIECE), behavior="isolated")])
    tok.decoder = decoders.Metaspace(**metaspace)
    tok.add_special_tokens(SPECIAL_TOKENS)  # so decode(..., skip_special_tokens=True) drops EOS padding and masks
    return tok


def _draw(make, split: str):
    # Rejection-sample until the prompt's hash puts it in the requested split (a fifth is "test", never trained on).
    if split not in ("train", "test", "any"):
        raise ValueError(f"split must be 'train', 'test' or 'any', got {split!r}")
    while True:
        ex = make()
        h = int.from_bytes(hashlib.sha1(ex["prompt"].encode()).digest()[:8], "big") / 2**64
        if split == "any" or ("test" if h < 0.2 else "train") == split:
            return ex


def make_text_example(rng: random.Random, split: str = "train", noise: float = 0.0, max_value: int = 9,
                      max_steps: int = 2) -> dict:
    """A word problem of max_steps - 1 or max_steps (at least one) steps `a +/- n = r` in [0, max_value]: `answer`
    is the true result, `solution` the right completion; with probability `noise` the `completion` boxes the amount
    before the last step (docs/differences.md, "The toy's SFT mistake"): right working and length, never the answer."""
    def make():
        name, obj = rng.choice(sorted(NAMES)), rng.choice(OBJECTS)
        x = rng.randint(1, max_value)
        clauses, steps = [], []  # steps: (left, op, n, result)
        for _ in range(rng.randint(max(1, max_steps - 1), max_steps)):
            op = rng.choice([o for o in "+-" if (o == "+" and x < max_value) or (o == "-" and x > 0)])
            n = rng.randint(1, max_value - x) if op == "+" else rng.randint(1, x)
            clauses.append(rng.choice(ADD_VERBS if op == "+" else SUB_VERBS).format(n))
            steps.append((x, op, n, x + n if op == "+" else x - n))
            x = steps[-1][3]
        actions = " and ".join([" , ".join(clauses[:-1]), clauses[-1]] if len(clauses) > 1 else clauses)
        prompt = (f"{name} has {steps[0][0]} {obj} . {NAMES[name]} {actions} . "
                  f"how many {obj} does {NAMES[name]} have ?")
        return dict(prompt=prompt, steps=steps, answer=str(x))

    ex = _draw(make, split)
    steps = ex.pop("steps")
    work = " , ".join(f"{a} {op} {n} = {r}" for a, op, n, r in steps)
    ex["solution"] = f"{work} . {BOXED}{steps[-1][3]}}}"
    ex["completion"] = f"{work} . {BOXED}{steps[-1][0]}}}" if rng.random() < noise else ex["solution"]
    return ex


def make_image_example(rng: random.Random, split: str = "train", noise: float = 0.0, width: int = 4) -> dict:
    """A caption of one of GenEval's categories (single object, counting, two objects, relative position, placement),
    its checkable spec ({"width", "counts": {colour: n}, "relation", "place"}) and a valid grid (row-major codes, 0 =
    background, one cell per object); with probability `noise` the grid breaks one check (a systematic mistake)."""
    def make():
        kind = rng.choice(["single", "count", "two", "relation", "place"])
        a, b = rng.sample(COLOURS, 2)
        spec = {"width": width, "counts": {a: 1}, "relation": None, "place": None}
        prompt = f"a {a} block"
        if kind == "count":
            n = rng.randint(2, len(COUNT_WORDS))
            spec["counts"], prompt = {a: n}, f"{COUNT_WORDS[n]} {a} blocks"
        elif kind == "two":
            spec["counts"], prompt = {a: 1, b: 1}, f"a {a} block and a {b} block"
        elif kind == "relation":
            rel = rng.choice(sorted(RELATIONS))
            spec["counts"], spec["relation"], prompt = {a: 1, b: 1}, [a, rel, b], f"a {a} block {rel} a {b} block"
        elif kind == "place":
            place = rng.choice(sorted(PLACES))
            spec["place"], prompt = [a, place], f"a {a} block in the {place}"
        return dict(prompt=prompt, spec=spec)

    ex = _draw(make, split)
    codes = [COLOURS.index(c) + 1 for c, n in ex["spec"]["counts"].items() for _ in range(n)]
    while True:  # rejection-sample a grid that satisfies every check (a handful of tries at most)
        cells = dict(zip(rng.sample(range(width * width), len(codes)), codes))
        image = [cells.get(i, 0) for i in range(width * width)]
        if all(image_checks(image, ex["spec"])):
            break
    # the systematic mistake: the first named colour drawn as the next palette colour (its count check fails)
    ex["image"] = [x % len(COLOURS) + 1 if x == codes[0] else x for x in image] if rng.random() < noise else image
    return ex


def render_image(codes: list[int], width: int) -> str:
    """The grid as ANSI 256-colour blocks, one row per line ('??' for an invalid code)."""
    cell = [f"\x1b[48;5;{ANSI[c]}m  \x1b[0m" if 0 <= c < len(ANSI) else "??" for c in codes]
    return "\n".join("".join(cell[r:r + width]) for r in range(0, len(codes), width))
