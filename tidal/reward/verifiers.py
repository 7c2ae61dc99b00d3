"""Built-in answer checkers: pure functions of a response's text and the prompt's label
(`reward.fn: math`, `exact_match`)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from typing import Any

__all__ = ["BUILTIN_REWARDS", "exact_match", "extract_answer", "math_verify", "parse_number"]

# A number in free text. The look-behind keeps us from starting inside a word ("x2", "H2O") or
# after a decimal point, and makes "8-3" read as 8 and 3 rather than 8 and -3. Alternatives are
# tried in order: fraction, comma-grouped thousands, plain integer/decimal, bare ".5".
_TEXT_NUMBER_RE = re.compile(
    r"(?<![\w.])(?P<sign>-)?"
    r"(?P<body>\d+/\d+|\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)")
_LATEX_FRAC_RE = re.compile(r"(?P<sign>[+-]?)\s*\\[dt]?frac\s*\{(?P<num>[^{}]*)\}\s*\{(?P<den>[^{}]*)\}")
_SLASH_FRAC_RE = re.compile(r"(?P<num>[^/]+)/(?P<den>[^/]+)")


def _last_boxed(text: str) -> str | None:
    """Contents of the last complete ``\\boxed{...}``, matching nested braces; None if there is none.

    A truncated final ``\\boxed{`` with no closing brace is skipped in favour of an earlier complete
    one, since a cut-off answer is not an answer.
    """
    end = len(text)
    while True:
        start = text.rfind("\\boxed", 0, end)
        if start < 0:
            return None
        i = start + len("\\boxed")
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
        end = start


def extract_answer(text: str) -> str | None:
    """The final answer in a model response.

    The contents of the last ``\\boxed{...}`` (nested braces handled) if there is one, else the last
    number in the text: integers, decimals, negatives, thousands-grouped numbers such as ``1,234``
    (returned without commas) and simple fractions such as ``3/4`` or ``-3/4``. None if neither.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    last = None
    for last in _TEXT_NUMBER_RE.finditer(text):  # noqa: B007 - only the final match is wanted
        pass
    if last is None:
        return None
    return (last.group("sign") or "") + last.group("body").replace(",", "")


def _parse_plain(s: str) -> Fraction | None:
    s = s.strip()
    if not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    return Fraction(s.replace(",", "").rstrip("."))


def _parse_ratio(num: str, den: str) -> Fraction | None:
    a, b = _parse_plain(num), _parse_plain(den)
    if a is None or b is None or b == 0:
        return None
    return a / b


def parse_number(s: str) -> Fraction | None:
    """Parse `s` exactly as a rational number, or return None if it is not a plain number.

    Accepts integers, decimals (``0.25``, ``.5``), ``a/b``, ``\\frac{a}{b}``, ``\\dfrac{a}{b}``
    (and ``\\tfrac``), with an optional sign (a leading ``+`` included), thousands commas
    (``1,234`` or LaTeX ``1{,}234``), surrounding ``$`` and whitespace and a trailing period.
    Fractions with a zero denominator give None. Exact: ``parse_number("0.1") == Fraction(1, 10)``.
    """
    if not isinstance(s, str):
        return None
    t = s.strip().rstrip(".").strip().strip("$").strip().rstrip(".").strip()
    t = t.replace("{,}", ",")
    if not t:
        return None
    m = _LATEX_FRAC_RE.fullmatch(t)
    if m:
        value = _parse_ratio(m.group("num"), m.group("den"))
        if value is None:
            return None
        return -value if m.group("sign") == "-" else value
    m = _SLASH_FRAC_RE.fullmatch(t)
    if m:
        return _parse_ratio(m.group("num"), m.group("den"))
    return _parse_plain(t)


def _label_number(label: Any) -> Fraction | None:
    """An exact number from a dataset label, or None when the label is not numeric."""
    if isinstance(label, bool):
        return None  # True/False are answers like "yes"/"no", not 1/0
    if isinstance(label, numbers.Rational):
        return Fraction(int(label.numerator), int(label.denominator))
    if isinstance(label, Decimal):
        return Fraction(label) if label.is_finite() else None
    if isinstance(label, numbers.Real):
        value = float(label)
        if not math.isfinite(value):
            return None
        # Via repr, so the label 0.1 means the decimal 0.1 and not its binary approximation.
        return Fraction(repr(value))
    if isinstance(label, str):
        return parse_number(label)
    return None


def math_verify(response: str, label: Any) -> float:
    """1.0 if the response's final answer (see `extract_answer`) equals `label`, else 0.0.

    When both the answer and the label parse as numbers they are compared exactly as fractions,
    so "0.5", "1/2" and "\\frac{1}{2}" all match the label 0.5. When neither is numeric and the
    label is a string, the stripped texts are compared. A numeric answer never matches a
    non-numeric label or vice versa.
    """
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    got, want = parse_number(answer), _label_number(label)
    if got is not None and want is not None:
        return float(got == want)
    if got is None and want is None and isinstance(label, str):
        return float(answer.strip() == label.strip())
    return 0.0


def exact_match(response: str, label: Any) -> float:
    """1.0 if ``response.strip() == str(label).strip()``, else 0.0."""
    return float(response.strip() == str(label).strip())


BUILTIN_REWARDS: dict[str, Callable[[str, Any], float]] = {
    "math": math_verify,
    "exact_match": exact_match,
}
