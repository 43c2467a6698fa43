"""MATH scorer: the last ``\\boxed{…}`` of the response, checked for equivalence with the answer.

Extraction handles nested braces (``\\boxed{\\frac{1}{2}}``), the brace-less ``\\boxed 5`` form
and ``\\fbox``. Equivalence is decided by math-verify (symbolic/numeric comparison through
sympy) when it is installed and can parse both sides; otherwise, or when it cannot decide, by
comparing strings after `normalize_answer` (which removes spacing commands, ``\\left``/``\\right``,
units, dollar signs and so on). Either test saying "equal" is enough.

math-verify bounds its own work with ``signal.alarm``, which only works in a process's main
thread; in other threads it is called without its timeout (the reward manager's process pool
``timeout_s`` is the bound there).

Boundaries: a pure function of strings (math-verify is imported lazily, on first use).
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation

__all__ = ["compute_score", "is_equivalent", "last_boxed_answer", "normalize_answer"]


def last_boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\boxed ...`` / ``\\fbox{...}``; None if absent or unbalanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", i) and not text[i:].lstrip().startswith("{"):
        # "\boxed 5$" form: the answer runs to the next "$" or whitespace.
        match = re.match(r"\s+([^\s$]+)", text[i:])
        return match.group(1) if match else None
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _strip_text_wrappers(s: str) -> str:
    # A whole answer written as \text{...} (e.g. "\text{(C)}") is its content.
    match = re.fullmatch(r"\\(?:text|textbf|mathrm|mbox)\{(.*)\}", s)
    return match.group(1) if match else s


def _fix_fracs(s: str) -> str:
    # "\frac12" -> "\frac{1}{2}", "\frac1{x}" -> "\frac{1}{x}".
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalize_answer(answer: str) -> str:
    """A canonical string for comparing simple answers (numbers, fractions, short expressions)."""
    s = answer.strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    for spacing in ("\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "~"):
        s = s.replace(spacing, "")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = _strip_text_wrappers(s.strip())
    # Units: a trailing \text{...}/\mbox{...} after a value ("10 \text{ cm}").
    s = re.sub(r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z ]+\}$", "", s)
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    # "x=5" / "k = 5": keep the value when the left side is a single variable.
    s = re.sub(r"^[a-zA-Z]=", "", s)
    s = _fix_fracs(s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+/\d+", s):
        num, den = s.lstrip("-").split("/")
        s = ("-" if s.startswith("-") else "") + f"\\frac{{{num}}}{{{den}}}"
    if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)", s):
        try:
            value = Decimal(s).normalize()
            s = format(value, "f")
        except InvalidOperation:
            pass
    return s


def _math_verify_equal(answer: str, ground_truth: str, strict: bool = False) -> bool | None:
    """math-verify's verdict, or None when it is not installed or fails.

    ``strict`` parses ``answer`` as LaTeX only, without math-verify's fallback of picking a
    number out of free text: for scorers that compare a whole response (EasyR1's r1v without
    ``<answer>`` tags), where that fallback would find the answer in any text that mentions it.
    """
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        return None
    # signal.alarm (math-verify's timeout) only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    kwargs = {}
    if strict:
        kwargs["extraction_config"] = [
            LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)
        ]
    try:
        gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout)
        predicted = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout, **kwargs)
        if not gold or not predicted:
            return None
        return bool(verify(gold, predicted, timeout_seconds=timeout))
    except Exception:
        # math-verify raises on inputs sympy cannot handle; the string test still applies.
        return None


def is_equivalent(answer: str, ground_truth: str, use_math_verify: bool = True, strict: bool = False) -> bool:
    """Whether two boxed contents denote the same answer (``strict``: see `_math_verify_equal`)."""
    if use_math_verify and _math_verify_equal(answer, ground_truth, strict):
        return True
    return normalize_answer(answer) == normalize_answer(ground_truth)


def compute_score(
    solution_str: str,
    ground_truth: str,
    format_score: float = 0.0,
    score: float = 1.0,
    use_math_verify: bool = True,
) -> float:
    """``score`` if the last boxed answer is equivalent to ``ground_truth``, ``format_score`` if a
    boxed answer is present but wrong, 0.0 if there is none."""
    answer = last_boxed_answer(solution_str)
    if answer is None or not answer.strip():
        return 0.0
    return score if is_equivalent(answer, str(ground_truth), use_math_verify) else format_score
