"""Tokenizing prompt text with bounded work: a prompt that can never fit the context is refused after
tokenizing about as much text as would fit, however long it is.

Tokenizing costs time in proportion to the text, and the front end tokenizes before the engine sees
anything: a few multi-megabyte prompts would otherwise hold the front end's CPU for seconds before their
400, and every other request would wait behind them. So a long text is counted piece by piece, cut just
before a whitespace character (where a token begins), and refused as soon as the pieces already hold more
tokens than the budget. A cut can split what the whole text would tokenize as one token, so each cut is
allowed `CUT_SLACK` tokens of over-count: a text is refused only when it cannot fit even then. A text that
may fit is tokenized whole, exactly as before.
"""

from __future__ import annotations

PIECE_CHARS = 16384  # characters counted per piece of a long text; shorter texts are tokenized at once
CUT_SLACK = 8  # tokens a cut may add (a token split in two, a merge lost on each side)
CUT_SEARCH = 256  # how far back a cut looks for whitespace before cutting where it stands


def encode_within(tokenizer, text: str, budget: int) -> list[int] | None:
    """Token ids of `text` (as `tokenizer.encode` gives them), or None when it is certainly longer than
    `budget` tokens; the work done to say None is bounded by about `budget` tokens' worth of text."""
    if len(text) <= PIECE_CHARS:
        return tokenizer.encode(text)
    per_call = len(tokenizer.encode(""))  # the BOS each encode adds
    counted = cuts = start = 0
    while start < len(text):
        end = _cut(text, start + PIECE_CHARS)
        counted += len(tokenizer.encode(text[start:end])) - per_call
        cuts += 1
        if counted - CUT_SLACK * cuts > budget - per_call:
            return None
        start = end
    return tokenizer.encode(text)


def _cut(text: str, at: int) -> int:
    """Where to end a piece near `at`: just before the last whitespace within `CUT_SEARCH` characters."""
    if at >= len(text):
        return len(text)
    for i in range(at, max(at - CUT_SEARCH, 1), -1):
        if text[i].isspace():
            return i
    return at
