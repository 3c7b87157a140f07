"""The last ``\\boxed{…}`` of a text: the one parser behind data/ (MATH solutions) and rewards/ (dapo, gsm8k).

Only the LAST box counts, and only if its braces close: an earlier closed box does not rescue an unclosed last one
(DAPO's ``last_boxed_only_string``). Plain text in, the box's content out; no normalisation (the callers decide).
Also shared by both: which ground truths stand for a missing value (``is_null_answer``).
"""
from __future__ import annotations

BOXED = "\\boxed{"
FBOX = "\\fbox{"
BOXED_ONLY = (BOXED,)  # what the verifiers accept (DAPO / JustRL strict box, gsm8k)
BOXED_OR_FBOX = (BOXED, FBOX)  # what MATH solutions write
# a missing value written out as text (str(None), a dataframe's null or NaN): never a ground truth, since
# "\\boxed{None}" would then score as correct
NULL_ANSWERS = frozenset({"None", "null", "NULL", "nan", "NaN"})


def is_null_answer(answer) -> bool:
    """True for None and for the text of a missing value (NULL_ANSWERS); the loaders skip such rows, the verifiers
    refuse them."""
    return answer is None or (isinstance(answer, str) and answer.strip() in NULL_ANSWERS)


def last_boxed_content(text: str, markers: tuple[str, ...] = BOXED_OR_FBOX) -> str | None:
    """Content of the box opened by the last occurrence of any of `markers` (each ends with "{") in `text`, with
    balanced braces; None when there is no box or the last one never closes."""
    idx = max(text.rfind(m) for m in markers)
    if idx < 0:
        return None
    start = text.index("{", idx)
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return None
