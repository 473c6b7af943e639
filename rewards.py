"""Reward functions: pure functions from a completion (and its example) to a float in [0, 1].

MaskGRPO (arXiv:2510.02880) §6 scores GSM8K and MATH by the last \\boxed{} and code by the fraction of passing unit
tests (infra/sandbox.py); countdown and sudoku are d1's (arXiv:2504.12216). Model output never makes a reward raise;
a malformed dataset row raises ValueError naming the value. REWARDS maps a benchmark to reward(completion, example).
"""
import re
from fractions import Fraction

from infra.latex import math_equiv, normalize_math  # noqa: F401 (re-exported: callers import them from here)
from infra.sandbox import run_code  # the public API is rewards.run_code(program, tests, timeout) -> float

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"\\.|[{}]", re.S)  # an escaped character (\{, \}, \\) never counts as a brace


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces balanced; None if absent or unclosed:
    "so \\boxed{\\frac{1}{2}}." -> "\\frac{1}{2}";  "\\boxed{1} or \\boxed{2}" -> "2";  "\\boxed{3" -> None."""
    last = max(_BOX_OPEN.finditer(text), key=lambda m: m.start(), default=None)  # only the last one is scanned
    if last is None:
        return None
    depth = 1
    for m in _BRACE.finditer(text, last.end()):
        depth += (m.group() == "{") - (m.group() == "}")
        if depth == 0:
            return text[last.end():m.start()]
    return None  # a truncated generation: the last box never closes


def _answer_block(text: str) -> str | None:
    """Content of the last <answer>...</answer> (rfind: a regex would go quadratic), else of the last \\boxed{}."""
    close = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, close) if close >= 0 else -1
    return text[start + len("<answer>"):close] if start >= 0 else extract_boxed(text)


# GSM8K (numeric answers) and MATH (LaTeX answers, compared by infra/latex.py)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # 1,234,567 -> 1234567 but (2,100) stays a pair
_PLAIN_NUMBER = re.compile(r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(?:\s*[a-zA-Z]{2,})*")  # "18 dollars"; not 1e9
_MAX_NUMBER_CHARS = 100  # longer "numbers" score 0: never int() a 10^6-digit string


def extract_answer(text: str) -> str | None:
    """Final answer of a GSM8K-style text: the last \\boxed{} content, else what follows the last `####`:
    "... \\boxed{72}" -> "72";  "... #### 1,000" -> "1,000";  "no answer" -> None."""
    boxed, hashes = extract_boxed(text), re.findall(r"####([^\n]*)", text)
    return boxed.strip() if boxed is not None else hashes[-1].strip() if hashes else None


def _to_number(s: str) -> Fraction | None:
    """Exact value of a plain number with GSM8K dressing ($, commas, %, units, trailing '.'), or None."""
    if len(s) > _MAX_NUMBER_CHARS:
        return None
    s = re.sub(r"\\(?:text|mbox|mathrm)\{([^{}]*)\}", r"\1", s)
    for junk in ("\\$", "$", "\\%", "%", "\\!", "\\,"):
        s = s.replace(junk, "")
    s = _THOUSANDS.sub("", s).strip().rstrip(".")
    m = _PLAIN_NUMBER.fullmatch(s)
    return Fraction(m.group(1)) if m else None


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals the reference number (a `####` line or bare), else 0.0:
    ("... \\boxed{$1,000.00}", "#### 1000") -> 1.0;  ("#### +72 dollars", "72") -> 1.0."""
    pred = extract_answer(completion)
    return float(pred is not None and _to_number(pred) == _gsm8k_gold(answer))


def _gsm8k_gold(answer: str) -> Fraction:
    gold = _to_number(extract_answer(answer) or answer) if isinstance(answer, str) else None
    if gold is None:
        raise ValueError(f"gsm8k reference answer {str(answer)[:80]!r} is not a number")
    return gold


def math_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's last \\boxed{} is equivalent to the reference (bare answer or boxed solution):
    ("... \\boxed{\\dfrac{1}{2}}", "0.5") -> 1.0;  ("the answer is 2", "2") -> 0.0."""
    if not isinstance(answer, str):
        raise ValueError(f"math reference answer must be a str, got {answer!r:.80}")
    gold, pred = extract_boxed(answer), extract_boxed(completion)
    return float(pred is not None and math_equiv(pred, answer if gold is None else gold))


# countdown (d1): an arithmetic equation over given numbers, evaluated by our own parser, never eval
_CD_MAX_CHARS, _CD_MAX_DEPTH, _CD_MAX_DIGITS = 200, 20, 6
_CD_TOKEN = re.compile(r"[0-9]+|[-+*/()]")
_CD_OTHER = re.compile(r"[^0-9\s()*/+-]")
_CD_SYMBOLS = {"\\times": "*", "\\cdot": "*", "×": "*", "·": "*", "\\div": "/", "÷": "/", "\\left": "",
               "\\right": "", "$": ""}


def _cd_eval(tokens: list[str], used: list[int]) -> Fraction:
    """Recursive descent: expr = term (+|- term)*, term = factor (*|/ factor)*, factor = int | (expr) | -factor."""
    rest = tokens[::-1]  # the next token is rest[-1]

    def expr(depth: int, ops: str = "+-") -> Fraction:  # ops "*/": a term
        operand = factor if ops == "*/" else lambda d: expr(d, "*/")
        value = operand(depth)
        while rest and rest[-1] in ops:
            op, rhs = rest.pop(), operand(depth)
            value = (value + rhs if op == "+" else value - rhs if op == "-"
                     else value * rhs if op == "*" else value / rhs)
        return value

    def factor(depth: int) -> Fraction:
        if depth > _CD_MAX_DEPTH:
            raise ValueError("nested too deeply")
        tok = rest.pop()
        if tok == "(":
            value = expr(depth + 1)
            if rest.pop() != ")":
                raise ValueError("unbalanced parenthesis")
            return value
        if tok == "-":
            return -factor(depth + 1)
        if not tok.isdigit() or len(tok) > _CD_MAX_DIGITS:
            raise ValueError(f"bad operand {tok!r}")
        used.append(int(tok))
        return Fraction(int(tok))

    value = expr(0)
    if rest:
        raise ValueError(f"trailing token {rest[-1]!r}")
    return value


def countdown_reward(completion: str, numbers: list[int], target: int) -> float:
    """d1 countdown reward: 1.0 if the last <answer> (or \\boxed{}) equation uses each number once and hits the
    target ("= 37" tails ignored), 0.1 if an equation is there but wrong or invalid, 0.0 if there is none."""
    if not (isinstance(numbers, (list, tuple)) and numbers and all(type(n) is int for n in numbers)):
        raise ValueError(f"countdown numbers must be a non-empty list of int, got {numbers!r:.80}")
    if type(target) is not int:
        raise ValueError(f"countdown target must be an int, got {target!r:.80}")
    equation = _answer_block(completion)
    if equation is None or not equation.strip():
        return 0.0
    if len(equation) > _CD_MAX_CHARS:
        return 0.1
    for symbol, op in _CD_SYMBOLS.items():
        equation = equation.replace(symbol, op)
    equation, used = equation.split("=")[0].strip(), []
    if _CD_OTHER.search(equation):  # whitespace separates tokens; any other character is an error
        return 0.1
    try:
        value = _cd_eval(_CD_TOKEN.findall(equation), used)
    except (ValueError, IndexError, ZeroDivisionError):  # a malformed or cut-short equation, or / 0
        return 0.1
    return 1.0 if sorted(used) == sorted(numbers) and value == target else 0.1


def sudoku_reward(completion: str, puzzle: str, solution: str) -> float:
    """Fraction of the puzzle's empty cells (0s) filled correctly, from the 16 digits of the last <answer> block
    (or last \\boxed{}); separators are ignored and any other digit count scores 0 (d1 sudoku reward)."""
    for name, grid, digits in (("puzzle", puzzle, "0-4"), ("solution", solution, "1-4")):
        if not (isinstance(grid, str) and re.fullmatch(f"[{digits}]{{16}}", grid)):
            raise ValueError(f"sudoku {name} must be 16 digits in [{digits}], got {grid!r:.80}")
    cells = re.findall(r"[0-9]", _answer_block(completion) or "")  # ASCII digits only: no unicode look-alikes
    if len(cells) != 16:
        return 0.0
    empty = [i for i, c in enumerate(puzzle) if c == "0"] or list(range(16))
    return sum(cells[i] == solution[i] for i in empty) / len(empty)


def reasoning_format_reward(text: str) -> float:
    """1.0 if the text holds <reasoning>...</reasoning> (official `soft_format` scaled to [0, 1]), else 0.0."""
    start = text.find("<reasoning>")
    return float(start >= 0 and text.find("</reasoning>", start + len("<reasoning>")) >= 0)


def extract_code(completion: str) -> str:
    """The first ```python fenced block of a completion (to its end if unclosed), else the whole text (MBPP)."""
    m = re.search(r"```python(.*?)(?:```|\Z)", completion, re.S)
    return completion if m is None else m.group(1).lstrip("\n")


def _field(example: dict, name: str):
    """example[name] of an example as infra/data.py makes it, else a ValueError naming the keys it has."""
    if name not in example:
        raise ValueError(f"example needs the key {name!r}, has {sorted(example)}")
    return example[name]


def _on(reward, *names):
    """reward(completion, *example's fields `names`) as a registry entry reward(completion, example)."""
    return lambda completion, example: reward(completion, *(_field(example, name) for name in names))


REWARDS = {"gsm8k": _on(gsm8k_reward, "answer"), "math": _on(math_reward, "answer"),
           "countdown": _on(countdown_reward, "numbers", "target"), "sudoku": _on(sudoku_reward, "puzzle", "solution"),
           "mbpp": lambda completion, example: run_code(  # MBPP's setup runs after the solution, before the asserts
               extract_code(completion) + "\n" + (example.get("test_setup_code") or ""), _field(example, "test_list"))}


# the official MaskGRPO runs' shaped rewards, divided by their maximum: (r - mean) / std advantages ignore the
# scale; under r - mean alone (d1's) it scales every step by 1 / SHAPED_MAX[task], like a learning rate.
SHAPED_MAX = {"gsm8k": 3.0, "math": 2.5}


def gsm8k_shaped_reward(completion: str, answer: str) -> float:
    """Official GSM8K reward / 3.0: <reasoning>..</reasoning> 0.5, an answer of ASCII digits 0.5, a correct one
    ("72.0" counts) 2.0; the answer is the last closed \\boxed{}, else the whole completion."""
    gold, boxed = _gsm8k_gold(answer), extract_boxed(completion)
    pred = completion if boxed is None else boxed
    total = (0.5 * reasoning_format_reward(completion) + 0.5 * (re.fullmatch(r"[0-9]+", pred) is not None)
             + 2.0 * (_to_number(pred) == gold))
    return total / SHAPED_MAX["gsm8k"]


def math_shaped_reward(completion: str, answer: str) -> float:
    """Official MATH reward / 2.5: a correct last \\boxed{} 2.0 (by `math_equiv`, laxer than the official string
    match), plus 0.5 if "\\boxed" occurs at all (closed or not), else 0.25."""
    return (2.0 * math_reward(completion, answer) + (0.5 if "\\boxed" in completion else 0.25)) / SHAPED_MAX["math"]


SHAPED = {"gsm8k": _on(gsm8k_shaped_reward, "answer"), "math": _on(math_shaped_reward, "answer")}


def answer_reward(completion_text: str, example: dict) -> float:
    """Toy text (infra/toy.py): 1.0 if the last \\boxed{} holds the true answer, else 0.0 (also with no box)."""
    boxes = re.findall(r"\\boxed\{([^{}]*)\}", completion_text)
    return float(bool(boxes) and boxes[-1].strip() == example["answer"])


def solution_reward(completion_text: str, example: dict) -> float:
    """1.0 if the completion is the whole right solution, working (unique here: docs/results.md) and box."""
    return float(completion_text.strip() == example["solution"])


# The toy image world (infra/toy.py draws from it): code 0 background, code c >= 1 COLOURS[c - 1]; a relation
# puts one colour on a side of another (axis, sign), a place in the first or last row or column (axis, 0 or -1).
COLOURS = ["red", "green", "blue", "yellow", "purple", "cyan", "white"]
RELATIONS = {"left of": (1, -1), "right of": (1, 1), "above": (0, -1), "below": (0, 1)}
PLACES = {"top row": (0, 0), "bottom row": (0, -1), "left column": (1, 0), "right column": (1, -1)}


def image_checks(codes: list[int], spec: dict) -> list[bool]:
    """Each named colour's cell count, no stray colour, the relation (all of a strictly beside all of b) or place."""
    w = spec["width"]
    cells = {c: [divmod(i, w) for i, x in enumerate(codes) if x == COLOURS.index(c) + 1] for c in COLOURS}
    checks = [len(cells[c]) == n for c, n in spec["counts"].items()]
    checks.append({c for c in COLOURS if cells[c]} == set(spec["counts"]))
    if spec["relation"]:
        a, rel, b = spec["relation"]
        axis, sign = RELATIONS[rel]
        checks.append(bool(cells[a] and cells[b]) and all(sign * (q[axis] - p[axis]) > 0 for p in cells[b]
                                                           for q in cells[a]))
    if spec["place"]:
        a, place = spec["place"]
        axis, end = PLACES[place]
        checks.append(bool(cells[a]) and all(p[axis] == range(w)[end] for p in cells[a]))
    return checks


def image_reward(codes: list[int], example: dict) -> float:
    """The fraction of image_checks that hold (denser than GenEval's all-or-nothing); 0 for a wrong number of codes."""
    checks = image_checks(codes, example["spec"]) if len(codes) == example["spec"]["width"] ** 2 else [False]
    return sum(checks) / len(checks)
