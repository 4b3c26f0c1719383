"""
verify.py: the math reward: does a response's final answer equal the gold one? (paper section 2)

Start at score_problems (code problems go to sandbox.py), then score. The answer is the last
\\boxed{} after </think>, else the line after "Answer:". Strings and plain numbers decide at once
(quick_check); the rest goes to a sympy worker process killed at `timeout` and must be proven
equal for all real values: what sympy cannot prove is False. Never raises, never hangs.

    python verify.py '<think>...</think> \\boxed{2\\sqrt{2}}' '\\sqrt{8}'   # True
    python verify.py --bench   # verifications/s on a batch of 768
"""
import contextlib
import json
import os
import random
import re
import resource
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from itertools import accumulate

import sympy

from sandbox import score_code_batch

# past these an answer counts False
TIMEOUT = 5.0              # seconds
MAX_ANSWER_CHARS = 1000
MAX_DEPTH = 50             # bracket nesting
MAX_EXPONENT = 10_000      # factorials too
MAX_POWER_BITS = 330_000
WORKER_START_TIMEOUT = 120.0
WORKER_MEMORY = 4 << 30

# -----------------------------------------------------------------------------
# the final answer

_BOX_WORDS = ("\\boxed", "\\fbox")
_BOX = re.compile("|".join(map(re.escape, _BOX_WORDS)))
# also **Final Answer:** 12
_ANSWER_KEY = re.compile(r"####|final answer(?:\s*is)?[\s*:]*|the answer is[\s*:]*|"
                         r"\banswer\**\s*:[\s*]*", re.IGNORECASE)


def extract_answer(response):
    """A response's final answer, or None."""
    if not isinstance(response, str):
        return None
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    elif "<think>" in response:
        return None                      # cut off while thinking
    if _BOX.search(response):
        return last_boxed(response)
    keys = list(_ANSWER_KEY.finditer(response)) if _may_have_key(response) else None
    if keys:
        line = response[keys[-1].end():].split("\n", 1)[0]
        return _strip_answer(re.split(r"\.\s", line, maxsplit=1)[0])
    text = response.strip()
    if text and "\n" not in text and len(text) <= 100:
        return _strip_answer(text)
    return None


def _may_have_key(text):
    """Whether _ANSWER_KEY may match (its regex is slow)."""
    return "####" in text or "answer" in text.lower().replace("\u017f", "s")


def last_boxed(text):
    """The argument of the last \\boxed{} or \\fbox{}, or None."""
    at, word = max((text.rfind(word), word) for word in _BOX_WORDS)
    return _box_content(text, at + len(word)) if at >= 0 else None


def _box_content(text, start):
    rest = text[start:start + MAX_ANSWER_CHARS + 10].lstrip()
    if not rest.startswith("{"):
        token = re.match(r"[^\s$]+", rest)                    # \boxed 5
        return (token.group(0).rstrip(".,;") or None) if token else None    # \boxed 5. -> 5
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i].strip() or None
    return None


def _strip_answer(text):
    text = text.strip().rstrip(".").strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right) and len(text) > len(left) + len(right):
            text = text[len(left):-len(right)]
    return text.strip() or None

# -----------------------------------------------------------------------------
# normalization, in process

_REPLACE = [("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\dbinom", "\\binom"),
            ("\\tbinom", "\\binom"), ("\\displaystyle", ""), ("\\$", ""), ("$", ""),
            ("\\%", ""), ("%", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\circ", ""),
            ("\\degree", ""), ("°", ""), ("\\lbrace", "\\{"), ("\\rbrace", "\\}"),
            ("\\leq", "\\le"), ("\\geq", "\\ge"), ("−", "-"), ("π", "\\pi"), ("∞", "\\infty"),
            ("{,}", ",")]
_SIZING = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])")
_SPACING = re.compile(r"(?<!\\)\\[,;:! ]|~|\\q?quad(?![a-zA-Z])")
_TEXT = re.compile(r"\\(text\w*|mbox|math\w+|operatorname)\s*\{([^{}]*)\}(\^\{?\d\}?)?")
_LIST_WORD = re.compile(r"\\(?:text|mbox|textrm|textnormal)\s*\{\s*(?:and|or)\s*\}", re.I)
_UNIT_TEXT = re.compile(r"[a-zA-Z .]*(?:/ *[a-zA-Z][a-zA-Z .]*)*")     # \text{ km/h}: no digits
# 18 km/h
_UNIT_WORDS = re.compile(r"(-?[\d.,]*\d) +([a-zA-Z]{2,}(?:[ /]+[a-zA-Z]+)*)(?:\^\{?\d\}?)?")
# an allow-list: other words stay, so "5 or more" matches nothing
_UNITS = frozenset("""
    m cm mm km um nm in inch ft foot feet yd yard mi mile meter metre centimeter centimetre
    millimeter millimetre kilometer kilometre micrometer nanometer
    sq square cubic cu acre hectare ha l liter litre ml milliliter millilitre cc gallon gal quart
    qt pint pt cup fl ounce oz tbsp tsp tablespoon teaspoon
    g kg mg gram gramme kilogram milligram lb lbs pound ton tonne
    s sec second ms millisecond min minute h hr hrs hour day week wk month year yr yrs decade
    century centuries
    dollar usd cent penny pennies pence euro eur yen rupee franc peso yuan dime nickel quarter
    degree deg radian rad celsius fahrenheit kelvin c f k
    mph kph kmh rpm bpm fps per unit time point percent pct
    n newton j joule kj cal kcal calorie w watt kw kwh v volt amp ampere ohm hz khz mhz ghz pa
    kpa atm psi mol mole bit byte kb mb gb tb
""".split())
_GREEK = set("alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa "
             "lambda mu nu xi rho sigma tau upsilon phi varphi chi psi omega Gamma Delta "
             "Theta Lambda Xi Sigma Phi Psi Omega".split())
_VAR_PREFIX = re.compile(r"(?:[a-zA-Z](?:_\w)?|\\(?:%s)(?![a-zA-Z]))(?:=|\\in(?![a-zA-Z]))"
                         % "|".join(sorted(_GREEK)))            # x=, \theta=, not \neq= or \not=
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"-?(?:\d+\.?\d*|\.\d+|\d+/\d+)")             # 12, -3.5, .25, 3/4
_PM = re.compile(r"\\(?:pm|mp)(?![a-zA-Z])")
_FRACTION = re.compile(r"(-?)(\d+)?\\frac\{(\d+)\}\{(\d+)\}")        # \frac{3}{4}, 1\frac{4}{5}


def normalize(answer, listed=None):
    """A canonical string: equal strings, equal answers."""
    s = answer.strip()
    for old, new in _REPLACE:
        s = s.replace(old, new)
    spaced = re.search(r",\s", s) or _LIST_WORD.search(s)  # "10,\!080" and "1{,}000" are not
    s = _SPACING.sub(" ", _SIZING.sub("", s))
    s = _drop_text(s)
    s = re.sub(r"\s+", " ", s).strip().removesuffix(".")
    m = _UNIT_WORDS.fullmatch(s)
    s = m.group(1) if m and _units_only(m.group(2)) else s
    s = re.sub(r"(?<![a-zA-Z]) | (?![a-zA-Z])", "", s)         # keep only "\cot x"-like spaces
    s = re.sub(r"\\(frac|sqrt) ?([0-9a-zA-Z])", r"\\\1{\2}", s)    # \frac34 -> \frac{3}4
    s = re.sub(r"\\frac(\{[^{}]*\}) ?([0-9a-zA-Z])", r"\\frac\1{\2}", s)   # -> \frac{3}{4}
    s = re.sub(r"_\{(\w)\}", r"_\1", s)                        # 4210_{5} -> 4210_5
    named, s = s, _drop_variable(s)
    if listed is None:
        listed = bool(spaced) or named != s
    if _THOUSANDS.fullmatch(s) and not listed:
        s = s.replace(",", "")
    choice = re.fullmatch(r"\(([A-E])\)", s)                   # multiple choice (B) -> B
    return choice.group(1) if choice else s


def _units_only(text):
    words = [w for w in re.split(r"[\s/.]+", text.lower()) if w]
    return all(w in _UNITS or (w[-1:] == "s" and w[:-1] in _UNITS)
               or (w[-2:] == "es" and w[:-2] in _UNITS) for w in words)


def _drop_text(s):
    """\\text{Evelyn} -> Evelyn, 5\\text{ m/s} -> 5; words off _UNITS stay."""
    whole = _TEXT.fullmatch(s.strip())
    if whole and not whole.group(3):
        return whole.group(2).strip()

    def replace(m):
        command, inner, power = m.groups()
        if command in ("text", "mbox", "textrm", "textnormal") and _UNIT_TEXT.fullmatch(inner):
            if inner.strip().lower() in ("and", "or"):
                return ","
            if _units_only(inner):
                return ""
        return inner + (power or "")
    return _TEXT.sub(replace, s)


def _drop_variable(s):
    """x=5 -> 5, x=-1,x=2 -> -1,2."""
    items = _split_top(s, ",")
    prefixes = {m.group(0) for m in map(_VAR_PREFIX.match, items) if m}
    if len(prefixes) != 1:
        return s
    prefix = prefixes.pop()
    rests = [item.removeprefix(prefix) for item in items]
    return ",".join(rest if "=" not in rest else item for item, rest in zip(items, rests))


def as_number(s):
    """The exact value of a plain number, or None."""
    m = _FRACTION.fullmatch(s)
    with contextlib.suppress(ZeroDivisionError):
        if _DECIMAL.fullmatch(s):
            return Fraction(s)
        if m:
            sign, whole, numerator, denominator = m.groups()
            value = int(whole or 0) + Fraction(int(numerator), int(denominator))
            return -value if sign else value
    return None


def quick_check(answer, gold):
    """True or False, or None when sympy must decide."""
    if len(answer) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    a, b = _normalize_pair(answer, gold)
    if not a or not b:
        return False
    if a == b:
        return True
    if (len(a) > 1 and a.isalpha()) or (len(b) > 1 and b.isalpha()):
        return a.lower() == b.lower()          # words (east, Evelyn) are not products e*a*s*t
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        return x == y
    return None


def _normalize_pair(answer, gold):
    b = normalize(gold)
    return normalize(answer, listed=len(_split_top(b, ",")) > 1), b


def never_matched(gold):
    """Why no response can match this gold, or None."""
    if len(gold) > MAX_ANSWER_CHARS:
        return f"longer than {MAX_ANSWER_CHARS} characters"
    return None if normalize(gold) else "nothing is left of it once normalized"

# -----------------------------------------------------------------------------
# shapes and sympy, in a worker


def equivalent(answer, gold):
    """Whether two answers are equal, sympy included."""
    quick = quick_check(answer, gold)
    if quick is not None:
        return quick
    a, b = _normalize_pair(answer, gold)
    if max(_depths(a) + _depths(b)) > MAX_DEPTH:
        return False
    try:
        return _same(_shape(a), _shape(b))
    except Exception:          # unreadable LaTeX, ...
        return False


def _depths(s):
    return list(accumulate((ch in "([{") - (ch in ")]}") for ch in s))


def _shape(s):
    """('seq', brackets, items), ('set', items), ('eq', lhs, rhs) or ('value', s)."""
    m = re.fullmatch(r"\\begin\{[pbvB]?matrix\}(.*)\\end\{[pbvB]?matrix\}", s)
    if m:
        rows = [row.split("&") for row in m.group(1).split("\\\\") if row]
        return ("seq", "matrix", [("seq", "row", [("value", c) for c in row]) for row in rows])
    unions = _split_top(s, "\\cup")
    if len(unions) > 1:
        return ("set", [_shape(part) for part in unions])
    if s.startswith("\\{") and s.endswith("\\}"):
        return ("set", [_shape(x) for item in _split_top(s[2:-2], ",") for x in _expand_pm(item)])
    if s[:1] in ("(", "[") and s[-1:] in (")", "]") and 0 not in _depths(s)[:-1]:
        items = _split_top(s[1:-1], ",")
        if len(items) > 1:
            return ("seq", s[0] + s[-1], [_shape(item) for item in items])
    items = [x for item in _split_top(s, ",") for x in _expand_pm(item)]
    if len(items) > 1:
        return ("set", [_shape(item) for item in items])
    sides = _split_top(s, "=")
    if len(sides) == 2:
        return ("eq", sides[0], sides[1])
    return ("value", s)


def _split_top(s, sep):
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if s[i] in "([{":
            depth += 1
        elif s[i] in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            start = i = i + len(sep)
            continue
        i += 1
    return parts + [s[start:]]


def _expand_pm(s):
    signs = list(_PM.finditer(s))
    if not signs or len(signs) > 3:
        return [s]
    m = signs[0]
    head, tail = s[:m.start()], s[m.end():]
    return _expand_pm(head + "+" + tail) + _expand_pm(head + "-" + tail)


def _same(x, y):
    if x[0] != y[0]:
        return False
    if x[0] == "value":
        return _same_value(x[1], y[1])
    if x[0] == "eq":
        return _same_equation(x, y)
    if x[0] == "seq":
        return x[1] == y[1] and len(x[2]) == len(y[2]) and all(map(_same, x[2], y[2]))
    unmatched = list(y[1])                         # sets: pair each item
    if len(x[1]) != len(unmatched):
        return False
    for item in x[1]:
        match = next((j for j, other in enumerate(unmatched) if _same(item, other)), None)
        if match is None:
            return False
        unmatched.pop(match)
    return True


def _same_value(a, b):
    if a == b:
        return True
    u, v = to_sympy(a), to_sympy(b)
    if u == v:
        return True
    if (u.is_Rational and v.is_Rational) or any(e.has(*_INFINITE) for e in (u, v)):
        return False
    return _identical(u, v)


def _same_equation(x, y):
    d1 = to_sympy(x[1]) - to_sympy(x[2])
    d2 = to_sympy(y[1]) - to_sympy(y[2])
    return d1 != 0 and d2 != 0 and _identical(d1, d2, multiple=True)


def _identical(u, v, multiple=False):
    """u equals v (multiple: c * v) for all real values, proven: points only reject."""
    if u.free_symbols - v.free_symbols or not _agree_at_points(u, v, multiple):
        return False
    gap = u / v if multiple else u - v
    simple = sympy.cancel(gap) if _rational_function(gap) else sympy.simplify(gap)
    return not simple.free_symbols and simple.is_zero is (not multiple)


def _rational_function(e):
    if e.is_Symbol or e.is_Rational:
        return True
    if e.is_Pow:
        return e.exp.is_Integer and _rational_function(e.base)
    return (e.is_Add or e.is_Mul) and all(map(_rational_function, e.args))


def _agree_at_points(u, v, multiple):
    pairs = [(_value(u, point), _value(v, point)) for point in _points(u, v)]
    if multiple:
        if any(q == 0 for _, q in pairs):
            return False
        pairs = [(p / q, pairs[0][0] / pairs[0][1]) for p, q in pairs]
    return all(_close(p, q) for p, q in pairs)


def _points(u, v, count=8):
    """Beyond every constant and its reciprocal, fresh random ones, around roots."""
    symbols = sorted(v.free_symbols, key=str)
    if not symbols:
        return [{}]
    rng = random.SystemRandom()
    big = (10 * max([1] + [abs(n) for n in (u.atoms(sympy.Rational) | v.atoms(sympy.Rational))])
           + _fresh(rng))
    points = [{s: sign * scale * (k + 1) for k, s in enumerate(symbols)}
              for sign in (1, -1) for scale in (big, 1 / big)]
    points += [{s: rng.choice((-1, 1)) * _fresh(rng) for s in symbols} for _ in range(count)]
    for s in symbols:
        points += [{**rng.choice(points[4:]), s: value} for value in _sides_of_roots(u, v, s)]
    return points


def _fresh(rng):
    """A random rational on no shared grid: no seed an answer could know."""
    denominator = rng.randint(10**6, 10**12)
    return sympy.Rational(int(denominator * 10 ** rng.uniform(-6, 4)) + 1, denominator)


def _sides_of_roots(u, v, s):
    roots = set()
    for f in (u.atoms(sympy.Abs, sympy.Pow, sympy.log) | v.atoms(sympy.Abs, sympy.Pow, sympy.log)):
        arg = f.base if f.is_Pow else f.args[0]
        if (f.is_Pow and f.exp.is_Integer) or arg.free_symbols != {s} or not arg.is_polynomial(s):
            continue
        poly = sympy.Poly(arg, s)
        if poly.domain in (sympy.ZZ, sympy.QQ) and poly.degree() <= 20:
            roots.update(r.evalf(60) for r in poly.real_roots())
    roots = sorted(roots)
    return ([a + (b - a) / 2 for a, b in zip(roots, roots[1:])]
            + ([roots[0] - 1, roots[-1] + 1] if roots else []))


def _value(expr, point):
    value = expr.evalf(60, subs=point)
    if not (value.is_number and value.is_finite):
        raise ValueError(f"{expr} is not a finite number at {point}")
    return value


def _close(u, v, tolerance=1e-40):
    return bool(abs(u - v) <= tolerance * (max(abs(u), abs(v)) + 1e-16))

# -----------------------------------------------------------------------------
# LaTeX to sympy: recursive descent


_TOKEN = re.compile(r"\\[a-zA-Z]+|\\.|[a-zA-Z]_(?:\{\w*\}|\w)|\d|\S")   # x_{12} is one token
_INFINITE = (sympy.oo, -sympy.oo, sympy.zoo, sympy.nan)
_CONSTANTS = {"\\pi": sympy.pi, "\\infty": sympy.oo}
_FUNCTIONS = {"\\sin": sympy.sin, "\\cos": sympy.cos, "\\tan": sympy.tan, "\\cot": sympy.cot,
              "\\sec": sympy.sec, "\\csc": sympy.csc, "\\arcsin": sympy.asin,
              "\\arccos": sympy.acos, "\\arctan": sympy.atan, "\\sinh": sympy.sinh,
              "\\cosh": sympy.cosh, "\\tanh": sympy.tanh, "\\exp": sympy.exp,
              "\\ln": sympy.log, "\\log": sympy.log}
_CLOSER = {"(": ")", "[": "]", "{": "}"}


def to_sympy(s):
    """The sympy value of a normalized LaTeX scalar; ValueError when unreadable."""
    number = as_number(s)
    if number is not None:
        return sympy.Rational(number.numerator, number.denominator)
    tokens = _TOKEN.findall(s)[::-1]            # a stack: pop() is next
    value = _sum(tokens)
    if tokens:
        raise ValueError(f"unexpected {tokens[-1]!r} in {s!r}")
    return value


def _peek(tokens):
    return tokens[-1] if tokens else None


def _expect(tokens, token):
    if _peek(tokens) != token:
        raise ValueError(f"expected {token!r}")
    tokens.pop()


def _sum(tokens):
    value = _product(tokens)
    while _peek(tokens) in ("+", "-"):
        sign = tokens.pop()
        term = _product(tokens)
        value = value + term if sign == "+" else value - term
    return value


def _product(tokens):
    value = _signed(tokens)
    while tokens:
        if tokens[-1] in ("*", "\\cdot", "\\times"):
            tokens.pop()
            value = value * _signed(tokens)
        elif tokens[-1] in ("/", "\\div"):
            tokens.pop()
            value = value / _signed(tokens)
        elif _starts_atom(tokens[-1]):                   # 2\sqrt{2}, 3x
            value = value * _power(tokens)
        else:
            break
    return value


def _signed(tokens):
    if _peek(tokens) in ("+", "-"):
        sign = tokens.pop()
        value = _signed(tokens)
        return -value if sign == "-" else value
    return _power(tokens)


def _power(tokens):
    value = _atom(tokens)
    while _peek(tokens) == "!":
        tokens.pop()
        if not (value.is_Integer and 0 <= value <= MAX_EXPONENT):
            raise ValueError("factorial of a non-integer or of a huge number")
        value = sympy.factorial(value)
    if _peek(tokens) == "^":
        tokens.pop()
        value = _checked_pow(value, _exponent(tokens))
    return value


def _exponent(tokens):
    if _peek(tokens) == "-":
        tokens.pop()
        return -_exponent(tokens)
    return _atom(tokens)


def _checked_pow(base, exponent):
    if exponent.is_Number:
        if abs(exponent) > MAX_EXPONENT:
            raise ValueError("exponent too large")
        if base.is_Rational and base not in (0, 1, -1):
            bits = max(abs(base.p).bit_length(), base.q.bit_length())
            if abs(exponent) * bits > MAX_POWER_BITS:
                raise ValueError("power too large")
    return base ** exponent


def _arg(tokens):
    t = _peek(tokens)
    if t is not None and t.isdigit():
        return sympy.Integer(tokens.pop())
    return _atom(tokens)


def _is_symbol(t):
    return (t[0].isalpha() and (len(t) == 1 or t[1] == "_")) or t[1:] in _GREEK


def _starts_atom(t):
    return (t.isdigit() or t in ("(", "{", ".", "\\frac", "\\sqrt", "\\binom")
            or t in _FUNCTIONS or t in _CONSTANTS or _is_symbol(t))


def _atom(tokens):
    if not tokens:
        raise ValueError("missing operand")
    t = tokens.pop()
    if t.isdigit() or t == ".":
        while tokens and (tokens[-1].isdigit() or (tokens[-1] == "." and "." not in t)):
            t += tokens.pop()
        number = Fraction(t)
        return sympy.Rational(number.numerator, number.denominator)
    if t in _CLOSER:
        value = _sum(tokens)
        _expect(tokens, _CLOSER[t])
        return value
    if t == "|":
        value = _sum(tokens)
        _expect(tokens, "|")
        return sympy.Abs(value)
    if t == "\\frac":
        return _arg(tokens) / _arg(tokens)
    if t == "\\binom":
        n, k = _arg(tokens), _arg(tokens)
        if n.is_Number and abs(n) > MAX_EXPONENT:
            raise ValueError("binomial of a huge number")
        return sympy.binomial(n, k)
    if t == "\\sqrt":
        index = sympy.Integer(2)
        if _peek(tokens) == "[":
            tokens.pop()
            index = _sum(tokens)
            _expect(tokens, "]")
        return sympy.root(_arg(tokens), index)
    if t in _FUNCTIONS:
        return _function(t, tokens)
    if t in _CONSTANTS:
        return _CONSTANTS[t]
    if _is_symbol(t):
        name = t.lstrip("\\").replace("{", "").replace("}", "")
        return {"i": sympy.I, "e": sympy.E}.get(name, sympy.Symbol(name, real=True))
    raise ValueError(f"cannot read {t!r}")


def _function(name, tokens):
    power = base = None
    if _peek(tokens) == "^":
        tokens.pop()
        power = _exponent(tokens)
    if name == "\\log" and _peek(tokens) == "_":
        tokens.pop()
        base = _arg(tokens)
    argument = _power(tokens)
    value = sympy.log(argument, base) if base is not None else _FUNCTIONS[name](argument)
    return value if power is None else _checked_pow(value, power)


# -----------------------------------------------------------------------------
# workers: sympy under a time limit

_idle_workers = []
_workers_lock = threading.Lock()


def _start_worker():
    worker = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, bufsize=0, start_new_session=True)
    if _read_line(worker, WORKER_START_TIMEOUT) != b"ready":
        worker.kill()
        worker.wait()
        raise RuntimeError("verify.py: the sympy worker process did not start")
    return worker


def _read_line(worker, timeout):
    deadline = time.monotonic() + timeout
    poller = select.poll()                 # select.select fails on fds over 1023
    poller.register(worker.stdout, select.POLLIN)
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return None
        chunk = os.read(worker.stdout.fileno(), 64)
        if not chunk:
            return None
        data += chunk
    return data.strip()


def _ask_worker(answer, gold, timeout):
    with _workers_lock:
        live = [w for w in _idle_workers if w.poll() is None]
        worker = live.pop() if live else None
        _idle_workers[:] = live
    worker = worker or _start_worker()
    try:
        worker.stdin.write(json.dumps([answer, gold]).encode() + b"\n")
        reply = _read_line(worker, timeout)
    except OSError:
        reply = None
    if reply is None:                           # too slow or crashed
        worker.kill()
        worker.wait()
        return False
    with _workers_lock:
        _idle_workers.append(worker)
    return reply == b"1"


def _forget_workers_after_fork():
    global _workers_lock
    _workers_lock = threading.Lock()
    _idle_workers.clear()


os.register_at_fork(after_in_child=_forget_workers_after_fork)


def _serve():
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, resource.RLIM_INFINITY))
    equivalent("\\frac{x}{2}", "x/2")          # warm up
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            same = equivalent(*json.loads(line))
        except Exception:
            same = False
        print(int(same), flush=True)

# -----------------------------------------------------------------------------
# public API


def _try_quick(response, gold):
    try:
        answer = extract_answer(response)
        if answer is None or not isinstance(gold, str):
            return answer, False
        return answer, quick_check(answer, gold)
    except Exception:
        return None, False


def prompt_opens_think(prompt):
    """Whether a prompt ends inside a <think> (DeepSeek-R1's templates)."""
    return isinstance(prompt, str) and prompt.rstrip().endswith("<think>")


def _opened(responses, think_open):
    flags = think_open if isinstance(think_open, (list, tuple)) else [think_open] * len(responses)
    if len(flags) != len(responses):
        raise ValueError(f"{len(responses)} responses but {len(flags)} think_open flags")
    return ["<think>" + r if flag and isinstance(r, str) else r
            for r, flag in zip(responses, flags)]


def score(response, gold, timeout=TIMEOUT, think_open=False):
    """True when the final answer equals gold; never raises."""
    answer, verdict = _try_quick(_opened([response], think_open)[0], gold)
    return verdict if verdict is not None else _ask_worker(answer, gold, timeout)


def score_batch(responses, golds, workers=2, timeout=TIMEOUT, think_open=False):
    """score for many, over `workers` sympy processes."""
    if len(responses) != len(golds):
        raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
    responses = _opened(responses, think_open)
    checked = [_try_quick(response, gold) for response, gold in zip(responses, golds)]
    results = [verdict for _, verdict in checked]
    pending = [i for i, verdict in enumerate(results) if verdict is None]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        slow = pool.map(lambda i: _ask_worker(checked[i][0], golds[i], timeout), pending)
        for i, verdict in zip(pending, slow):
            results[i] = verdict
    return results


def score_problems(responses, problems, workers=2, unsafe_code=False, think_open=False):
    """Verdicts for math and code problems (data.py's dicts)."""
    responses = _opened(responses, think_open)
    results = [False] * len(responses)
    judges = (("math", score_batch, "answer", {}),
              ("code", score_code_batch, "tests", {"unsafe": unsafe_code}))
    for domain, judge, field, extra in judges:
        idx = [i for i, p in enumerate(problems) if p.get("domain", "math") == domain]
        if idx:
            verdicts = judge([responses[i] for i in idx], [problems[i][field] for i in idx],
                             workers=workers, **extra)
            for i, v in zip(idx, verdicts):
                results[i] = v
    return results


def reward(response, problem, correct, finish):
    """+1 for a verified-correct answer, -1 otherwise (a graded reward goes here)."""
    return 1.0 if correct else -1.0


def bench(n=768, workers=2):
    """Verifications per second on 768 pairs, cold and warm."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                        "verify_pairs.jsonl")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][1:]              # line 1 is a comment
    rows = [rows[i % len(rows)] for i in range(n)]
    responses, golds = [r["response"] for r in rows], [r["gold"] for r in rows]
    to_sympy_workers = sum(_try_quick(r, g)[1] is None for r, g in zip(responses, golds))
    for run in ("cold", "warm"):
        start = time.perf_counter()
        score_batch(responses, golds, workers=workers)
        seconds = time.perf_counter() - start
        print(f"{run}: {n} verifications in {seconds:.2f} s = {n / seconds:.0f} verifications/s "
              f"(workers={workers}, {to_sympy_workers} of {n} went to the sympy workers)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _serve()
    elif sys.argv[1:] == ["--bench"]:
        bench()
    else:
        print(score(sys.argv[1], sys.argv[2]))
