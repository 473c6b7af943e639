"""LaTeX answer equivalence for the MATH reward (arXiv:2510.02880 §6): `math_equiv(a, b) -> bool`, with no CAS:
`normalize_math`, a canonical string; `value`, a constant's value from a bounded parser (never eval), Gaussian-rational
Fractions while exact, else a complex float; `_equiv`, the structure. One-sided: a wrong answer is never accepted, a
right one in an unknown form may be ("2x = 6" is not 6). Bounded sizes: a hostile answer cannot hang or fill memory."""
import cmath
import math
import re
from fractions import Fraction
from functools import lru_cache

MAX_ANSWER_CHARS = 1000  # beyond this an answer is compared verbatim: normalising it buys nothing
_MAX_BITS, _MAX_FACTORIAL, _MAX_DEPTH, _MAX_ROOT = 4096, 200, 40, 12  # refused: larger Fractions, n!, nesting, roots

# stage 1: a canonical string
_UNIT_SUFFIX = re.compile(r"(.+?)\\(?:text|mbox|mathrm)\{\s*[a-zA-Z][a-zA-Z ]*\}(?:\^\{?\d\}?)?", re.S)
_UNIT_WORDS = (r"units?|cm|mm|km|meters?|metres?|centimeters?|inch(?:es)?|feet|foot|ft|yards?|miles?|mph|"
               r"degrees?|dollars?|cents?|seconds?|minutes?|hours?|days?|weeks?|years?|pounds?|ounces?|"
               r"gallons?|liters?|litres?|grams?|kg")
_PLAIN_UNIT = re.compile(rf"(.*?[0-9}}])\s*(?:(?:square|sq|cubic)\s+)?(?:{_UNIT_WORDS})(?:\^\{{?[23]\}}?)?\.?", re.S)


def normalize_math(s: str) -> str:
    """Canonical string of a MATH answer, without LaTeX spacing, sizing, units, degrees, %, $, 'x =' and spaces:
    "\\left( \\dfrac12, 3 \\right)" -> "(\\frac{1}{2},3)",  "90^\\circ" -> "90",  "x = 10,\\!080." -> "10080"."""
    if len(s) > MAX_ANSWER_CHARS:
        return s.strip()
    s = re.sub(r"\\(?:left|right|[bB]igg?[lr]?)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r",\s*\\!\s*", ",", s)  # 11,\! 111: a thousands comma, whatever the spaces around it
    s = re.sub(r"(\\\\)|\\[!,;: ]|~", lambda m: m.group(1) or "", s)  # spacing, but keep \\ row breaks
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°", "", s)
    s = re.sub(r"\\?\$", "", re.sub(r"\\?%", "", s))  # \% and % first, then \$ and $
    s = s.strip().rstrip(".").strip()
    unit = _UNIT_SUFFIX.fullmatch(s) or _PLAIN_UNIT.fullmatch(s)  # "15\mbox{ cm}^2", "12 cm" -> the number
    s = unit.group(1).strip() if unit else s  # a lone \text{Evelyn} is the answer: a unit needs a number first
    s = re.sub(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(frac|sqrt)\s*([0-9a-zA-Z]|\\[a-zA-Z]+)", r"\\\1{\2}", s)  # \frac12 -> \frac{1}2, \frac\pi4, \sqrt2
    s = re.sub(r"\\frac\{([^{}]*)\}\s*([0-9a-zA-Z]|\\[a-zA-Z]+)", r"\\frac{\1}{\2}", s)  # \frac{270}7 -> \frac{270}{7}
    s = re.sub(r"^[a-zA-Z]\s*(?:=|\\in)\s*(?=\S)", "", s)  # "x = 5", "x \in [-2,7]": keep the value
    # commas go only when the whole answer is one number, checked before spaces go, so "3, 500" stays a list
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s.strip()) else s  # 10,080
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"([\^_])\{(\w)\}", r"\1\2", s)  # x^{2} -> x^2, 4210_{5} -> 4210_5
    s = re.sub(r"^\(([A-E])\)$", r"\1", s)  # multiple choice "(B)" -> "B"
    return s.lower() if s.isalpha() and len(s) > 2 else s  # text answers: "East" == "east"


# stage 2: operations raise _Refuse rather than build a huge number; value() also refuses x/0 and float overflow
class _Refuse(Exception):
    """Not a constant we evaluate (a variable, an unknown command), or too large: compare as strings."""


_TOKEN = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+|\\[a-zA-Z]+|[a-zA-Z]|[-+*/^!(){}\[\]]")
_ONE, _MINUS_ONE = (Fraction(1), Fraction(0)), (Fraction(-1), Fraction(0))


def _check(v):
    if not (max(max(q.numerator.bit_length(), q.denominator.bit_length()) for q in v) <= _MAX_BITS
            if isinstance(v, tuple) else cmath.isfinite(v)):
        raise _Refuse("too large or not finite")
    return v


def _approx(v) -> complex:
    return complex(float(v[0]), float(v[1])) if isinstance(v, tuple) else v


def _arith(a, op: str, b):
    """a op b for op in "+-*/": exact while both values are, else a complex float."""
    if not (isinstance(a, tuple) and isinstance(b, tuple)):
        x, y = _approx(a), _approx(b)
        return _check(x + y if op == "+" else x - y if op == "-" else x * y if op == "*" else x / y)
    (p, q), (r, s) = a, b
    if op == "/":
        n = r * r + s * s
        return _check(((p * r + q * s) / n, (q * r - p * s) / n))
    return _check((p + r, q + s) if op == "+" else (p - r, q - s) if op == "-" else (p * r - q * s, p * s + q * r))


def _root(a, n: int):
    """Principal n-th root; exact when a is a rational n-th power (\\sqrt{4} = 2, \\sqrt{-9} = 3i)."""
    if not isinstance(a, tuple):
        if a.imag or a.real < 0:
            raise _Refuse("root of a complex or negative irrational number")
        return _check(complex(a.real ** (1 / n)))
    if a[1] != 0 or (a[0] < 0 and n % 2 == 0 and n != 2):
        raise _Refuse("root of a complex number, or an even root of a negative one")
    q = abs(a[0])
    num, den = (round(x ** (1 / n)) if x < 2 ** 1000 else -1 for x in (q.numerator, q.denominator))
    exact = num >= 0 and den > 0 and num ** n == q.numerator and den ** n == q.denominator
    r = Fraction(num, den) if exact else float(q) ** (1 / n)
    x, y = (0, r) if a[0] < 0 and n == 2 else (-r if a[0] < 0 else r, 0)  # \sqrt{-9} = 3i; an odd root keeps the sign
    return (Fraction(x), Fraction(y)) if exact else complex(x, y)


def _pow(a, b):
    n = int(b[0]) if isinstance(b, tuple) and b[1] == 0 and b[0].denominator == 1 else None  # an integer power
    if n is not None and abs(n) > _MAX_BITS:
        raise _Refuse("power too large")
    if n is not None and isinstance(a, tuple):
        result, base, k = _ONE, (a if n >= 0 else _arith(_ONE, "/", a)), abs(n)
        while k:  # square and multiply: each product is checked, so no step exceeds 2 * _MAX_BITS
            if k & 1:
                result = _arith(result, "*", base)
            k >>= 1
            base = _arith(base, "*", base) if k else base
        return result
    if n is None and isinstance(b, tuple) and b[1] == 0 and b[0].numerator in (1, -1) and b[0].denominator <= _MAX_ROOT:
        r = _root(a, b[0].denominator)  # x^{1/2} = \sqrt{x}
        return r if b[0] > 0 else _arith(_ONE, "/", r)
    base, exp = _approx(a), (_approx(b) if n is None else n)
    if n is None and (base.imag or base.real <= 0):
        raise _Refuse("non-integer power of a non-positive or complex base")
    return _check(base ** exp)


def _factorial(a, k: int = 0):
    if not (isinstance(a, tuple) and a[1] == 0 and a[0].denominator == 1 and 0 <= a[0] <= _MAX_FACTORIAL):
        raise _Refuse("factorial of a large or non-natural number")
    return (Fraction(math.factorial(int(a[0])) // math.factorial(k)), Fraction(0))  # n! / k!, k = 0 for n!


class _Parser:
    """Recursive descent: expr = term (+|- term)*;  term = unary ((* | / | \\times | \\cdot | \\div)? unary)*;
    unary = (+|-) unary | atom !* (^ arg)?;  atom = number | i | \\pi | (expr) | {expr} | \\frac arg arg | ..."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        if (tok := self.peek()) is None or expected not in (None, tok):
            raise _Refuse(f"expected {expected!r}, got {tok!r}")
        self.pos += 1
        return tok

    def nested(self, parse):  # "------1" or "\\sqrt\\sqrt..." must not exhaust the stack
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Refuse("nested too deeply")
        value = parse()
        self.depth -= 1
        return value

    def expr(self):
        value = self.term()
        while self.peek() in ("+", "-"):
            value = _arith(value, self.take(), self.term())
        return value

    def term(self):
        value = self.unary()
        while (op := self.peek()) not in (None, "+", "-", ")", "}", "]"):
            if op in ("*", "/", "\\times", "\\cdot", "\\div"):
                self.take()
            elif op == "\\frac" and re.fullmatch(r"[0-9.]+", self.tokens[self.pos - 1]):
                raise _Refuse("2\\frac{1}{2} is a mixed number, not a product")
            value = _arith(value, "/" if op in ("/", "\\div") else "*", self.unary())
        return value

    def unary(self):
        if self.peek() in ("+", "-"):
            sign, value = self.take(), self.nested(self.unary)
            return value if sign == "+" else _arith(_MINUS_ONE, "*", value)
        value = self.atom()
        while self.peek() == "!":
            self.take()
            value = _factorial(value)
        if self.peek() == "^":
            self.take()
            return _pow(value, self.arg())
        return value

    def arg(self):  # of ^, \\frac, \\sqrt: a braced group, or one token (\\frac12, x^2)
        if self.peek() == "{":
            return self.group("{", "}")
        if re.fullmatch(r"[0-9]+", self.peek() or ""):  # x^2; but x^10 reads as x^1 then 0 in LaTeX: ambiguous
            if len(tok := self.take()) > 1:
                raise _Refuse(f"multi-digit argument {tok!r} without braces")
            return (Fraction(int(tok)), Fraction(0))
        return self.nested(self.atom)

    def group(self, open_: str, close: str):
        self.take(open_)
        value = self.nested(self.expr)
        self.take(close)
        return value

    def atom(self):
        tok = self.peek()
        if tok in ("(", "{"):
            return self.group(tok, ")" if tok == "(" else "}")
        self.take()
        if re.fullmatch(r"[0-9.]+", tok):
            return _check((Fraction(tok), Fraction(0)))
        if tok in ("i", "\\pi"):
            return (Fraction(0), Fraction(1)) if tok == "i" else complex(math.pi)
        if tok == "\\frac":
            return _arith(self.arg(), "/", self.arg())
        if tok == "\\binom":
            n, k = self.arg(), self.arg()
            if not (isinstance(n, tuple) and isinstance(k, tuple) and k[1] == 0 and k[0].denominator == 1
                    and 0 <= k[0] <= n[0]):
                raise _Refuse("binomial of non-naturals")
            return _arith(_factorial(n, int(k[0])), "/", _factorial(_arith(n, "-", k)))
        if tok == "\\sqrt":
            index = self.group("[", "]") if self.peek() == "[" else (Fraction(2), Fraction(0))
            if not (isinstance(index, tuple) and index[1] == 0 and index[0] in range(2, _MAX_ROOT + 1)):
                raise _Refuse("root index")
            return _root(self.arg(), int(index[0]))
        raise _Refuse(f"not a constant: {tok!r}")


@lru_cache(maxsize=4096)
def value(s: str):
    """Exact (Fraction re, Fraction im) or complex-float value of a normalised constant expression, else None:
    "7!\\times2!" -> (10080, 0);  "7i-2" -> (-2, 7);  "\\sqrt{3}/3" -> 0.577...+0j;  "2x" -> None."""
    if len(s) > MAX_ANSWER_CHARS or not s:
        return None
    m = re.fullmatch(r"(-?)([0-9]{1,40})\\frac\{([0-9]{1,40})\}\{([0-9]{1,40})\}", s)
    if m and int(m.group(4)) != 0:  # MATH writes mixed numbers as 137\frac{1}{2}
        return ((int(m.group(2)) + Fraction(int(m.group(3)), int(m.group(4)))) * (-1 if m.group(1) else 1), Fraction(0))
    tokens = _TOKEN.findall(s)
    if "".join(tokens) != s:
        return None  # a character we do not evaluate (",", "|", "&", unicode ...)
    parser = _Parser(tokens)
    try:
        result = parser.expr()
    except (_Refuse, RecursionError, ZeroDivisionError, OverflowError, ValueError):
        return None
    return result if parser.peek() is None else None  # trailing tokens: not one expression


# stage 3: structure
def _split_top(s: str, sep: str) -> list[str]:
    """Split at `sep` outside any (), [] or {} (an interval like (3,4] closes with a different bracket)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if depth == 0 and i >= start and s.startswith(sep, i):
            parts.append(s[start:i])
            start = i + len(sep)
    return parts + [s[start:]]


def _rhs_of_name(s: str) -> str | None:
    """The value after a "name =" with no operator or leading digit in the name ("2x=6" keeps its "=")."""
    parts = _split_top(s, "=")
    if len(parts) != 2 or not parts[1] or re.match(r"[0-9]", parts[0]) or not re.search(r"[a-zA-Z]", parts[0]):
        return None
    return None if re.search(r"[-+*/^<>!,]|\\(?:times|cdot|div|pm)", parts[0]) else parts[1]


def _all_match(xs: list[str], ys: list[str], ordered: bool, depth: int) -> bool:
    """Element-wise equivalence, in order or as a multiset (greedy: equivalence is an equivalence relation)."""
    if len(xs) != len(ys) or len(xs) > 50:
        return False
    if ordered:
        return all(_equiv(a, b, depth + 1) for a, b in zip(xs, ys))
    free = list(ys)
    for a in xs:
        hit = next((k for k, b in enumerate(free) if _equiv(a, b, depth + 1)), None)
        if hit is None:
            return False
        free.pop(hit)
    return True


def _equiv(x: str, y: str, depth: int = 0, ordered: bool = False) -> bool:
    """Equality of two normalised answers: string, value, then structure (lists, sets and unions unordered)."""
    if x == y:
        return True
    if depth >= 6 or len(x) + len(y) > 2 * MAX_ANSWER_CHARS:
        return False
    if ("=" in x) != ("=" in y):  # a leading "name =" on one side only
        rx, ry = _rhs_of_name(x) if "=" in x else x, _rhs_of_name(y) if "=" in y else y
        return rx is not None and ry is not None and _equiv(rx, ry, depth + 1)
    vx, vy = value(x), value(y)
    if vx is not None or vy is not None:  # exact values exactly (1.414 != \\sqrt2), irrational ones to 1e-9
        if vx is None or vy is None or isinstance(vx, tuple) or isinstance(vy, tuple):
            return vx == vy
        return abs(vx - vy) <= 1e-9 * max(abs(vx), abs(vy))
    for sep, in_order in (("\\cup", False), (",", ordered)):  # a union's pieces, then a list's elements
        px, py = _split_top(x, sep), _split_top(y, sep)
        if len(px) > 1 or len(py) > 1:
            return _all_match(px, py, in_order, depth)
    mx, my = (re.fullmatch(r"\\begin\{([pb]matrix)\}(.*?)(?:\\\\)*\\end\{\1\}", t, re.S) for t in (x, y))
    if mx and my:  # pmatrix/bmatrix rows of "&"-separated entries: the same shape, then entry by entry in order
        rows_x, rows_y = ([row.split("&") for row in m.group(2).split("\\\\")] for m in (mx, my))
        return ([len(r) for r in rows_x] == [len(r) for r in rows_y]
                and _all_match(sum(rows_x, []), sum(rows_y, []), True, depth))
    if x.startswith("\\{") and x.endswith("\\}") and y.startswith("\\{") and y.endswith("\\}"):
        return _all_match(_split_top(x[2:-2], ","), _split_top(y[2:-2], ","), False, depth)  # sets: unordered
    if x[:1] in "([" and x[:1] == y[:1] and x[-1:] in ")]" and x[-1:] == y[-1:]:
        return _equiv(x[1:-1], y[1:-1], depth + 1, ordered=True)  # tuples and intervals keep order and ends
    return False


def math_equiv(a: str, b: str) -> bool:
    """Same canonical string, value or structure: ("0.5", "\\frac12"), ("7i - 2", "-2 + 7i") and ("3, 7, 5",
    "3, 5, 7") are; ("(3,5)", "(5,3)") and ("0.33", "\\frac13") are not."""
    return _equiv(normalize_math(a), normalize_math(b))
