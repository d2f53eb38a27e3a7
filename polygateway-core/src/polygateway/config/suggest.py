""" "Did you mean" for a mistyped key: the closest known name by edit distance."""

from __future__ import annotations

from collections.abc import Iterable


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions), case-insensitive."""
    a, b = a.lower(), b.lower()
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(
                min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b))
            )
        previous = current
    return previous[-1]


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate nearest to ``word``, if near enough to be a typo of it.

    Near enough: at most a third of the word's length in edits (at least 2), or the word is a
    prefix of the candidate (``PGW_CACHE_TTL`` for ``PGW_CACHE_TTL_S``). Ties go to the first.
    """
    best: tuple[int, str] | None = None
    limit = max(2, len(word) // 3)
    for candidate in dict.fromkeys(candidates):
        if candidate.lower() == word.lower() and candidate != word:
            return candidate
        distance = edit_distance(word, candidate)
        prefix = len(word) >= 4 and candidate.lower().startswith(word.lower())
        if (distance <= limit or prefix) and (best is None or distance < best[0]):
            best = (distance, candidate)
    return best[1] if best else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``" (did you mean X?)"`` or ``""``."""
    found = closest(word, candidates)
    return f" (did you mean {found}?)" if found else ""
