"""The prompts of `swa-runtime bench --serve --workload standard|copy`.

- `standard`: `--prompt-len` token ids drawn uniformly from the regular vocabulary (`bench.synthetic_prompts`),
  different at each concurrency level: nothing in them to copy.
- `copy`: a code-editing request whose answer copies most of its prompt: "Rewrite the following code,
  renaming `a_b` to `aB`; keep everything else ... exactly as it is." above a passage of this runtime's own
  source (the Python files of the installed `runtime` package), then the start of the answer ("The same
  code with `a_b` renamed to `aB`, everything else as it was:"). The file, the first line and the identifier
  are drawn with a RNG seeded by `--seed` and the level's request count (as the standard prompts are); the
  passage is as many whole lines as keep the prompt within `--prompt-len` tokens. A greedy model continues by
  copying the passage, which is what prompt lookup drafts (gemma3-270m, a base model, copies most of it,
  mostly without the renaming, now and then dropping a comment). The prompts follow the source: a commit
  that edits the files drawn changes them, so compare speculation on and off within one run
  (`--compare-speculation`), not across commits.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

WORKLOADS = ("standard", "copy")
MIN_PASSAGE_LINES = 4  # a draw whose file ends sooner is drawn again
MIN_FILL = 0.9  # ... and one whose prompt falls short of this share of --prompt-len
DRAWS = 50


@dataclass
class Workload:
    name: str
    prompts: dict[int, list[list[int]]]  # per concurrency level: the requests sent
    warmup: list[int]  # a prompt of its own: warming up on a measured one would leave it in the prefix cache
    sources: dict[int, list[str]] = field(default_factory=dict)  # copy: per level, each prompt's lines

    def describe(self) -> str:
        lengths = [len(p) for ps in self.prompts.values() for p in ps]
        what = ("synthetic token ids" if self.name == "standard" else
                "code-editing requests over passages of runtime/*.py (Rewrite the following code, renaming ...)")
        digest = hashlib.sha256(repr(sorted(self.prompts.items())).encode()).hexdigest()[:12]
        return (f"workload {self.name}: {what}; prompts of {min(lengths)}-{max(lengths)} tokens "
                f"(mean {sum(lengths) / len(lengths):.0f}), digest {digest}")


def build_workload(name: str, counts: dict[int, int], prompt_len: int, cfg) -> Workload:
    """The prompts of workload `name` for `cfg.model`: `counts[c]` requests at concurrency `c`."""
    if name == "standard":
        from runtime.bench import synthetic_prompts
        from runtime.models.registry import resolve_model

        vocab = 260 if resolve_model(cfg.model).kind == "tiny" else 262144
        return Workload(name, {c: synthetic_prompts(n, prompt_len, vocab, 2, cfg.seed) for c, n in counts.items()},
                        synthetic_prompts(1, prompt_len, vocab, 2, cfg.seed + 1)[0])
    if name == "copy":
        from runtime.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
        drawn = {c: copy_prompts(n, prompt_len, tokenizer.encode, f"{cfg.seed}-{n}") for c, n in counts.items()}
        warmup = copy_prompts(1, prompt_len, tokenizer.encode, f"{cfg.seed}-warmup")[0]
        return Workload(name, {c: [p.ids for p in ps] for c, ps in drawn.items()}, warmup.ids,
                        {c: [p.source for p in ps] for c, ps in drawn.items()})
    raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {name!r}")


@dataclass
class CopyPrompt:
    ids: list[int]
    text: str  # what `ids` encode (BOS aside)
    passage: str  # the code to copy, verbatim from `source`
    source: str  # "runtime/engine.py:41-75"


def source_files() -> list[tuple[str, list[str]]]:
    """(name, lines) of every Python file of the `runtime` package, in name order."""
    import runtime

    root = Path(runtime.__file__).parent
    return [(f"runtime/{p.relative_to(root).as_posix()}", p.read_text(encoding="utf-8").splitlines())
            for p in sorted(root.rglob("*.py"))]


def frame(passage: str, old: str | None, new: str | None) -> str:
    """The request around `passage`, renaming `old` to `new` (None: repeating it), and the start of the answer.
    Tried on gemma3-270m (8 prompts, 64 new tokens, ngram, 4 draft tokens): saying twice that everything else
    stays as it is got 82% of the draft tokens accepted, 4.2 tokens per verify; "Rewrite the following code,
    renaming ..." then "Rewritten code:" 69% and 3.7 (the model dropped comments and wandered off)."""
    if old:
        ask = (f"Rewrite the following code, renaming `{old}` to `{new}`; keep everything else, comments and "
               "blank lines included, exactly as it is.")
        answer = f"The same code with `{old}` renamed to `{new}`, everything else as it was:"
    else:
        ask = "Repeat the following code exactly as it is, comments and blank lines included."
        answer = "The same code, everything as it was:"
    return f"{ask}\n\n```python\n{passage}\n```\n\n{answer}\n\n```python\n"


def copy_prompts(n: int, prompt_len: int, encode, seed: str) -> list[CopyPrompt]:
    """`n` different copy prompts of at most `prompt_len` tokens (`encode`: text -> ids, BOS first)."""
    framing = len(encode(frame("", "an_identifier", "anIdentifier")))
    if framing + 20 > prompt_len:
        raise ValueError(f"--prompt-len {prompt_len} is too short for the copy workload: its framing takes "
                         f"{framing} tokens")
    rng = random.Random(f"copy-{seed}")
    files = [(name, lines) for name, lines in source_files() if len(lines) >= MIN_PASSAGE_LINES]
    prompts: list[CopyPrompt] = []
    seen: set[str] = set()
    for _ in range(n * DRAWS):
        if len(prompts) == n:
            return prompts
        name, lines = rng.choice(files)
        start = rng.randrange(len(lines) - MIN_PASSAGE_LINES + 1)
        while start < len(lines) and not lines[start].strip():
            start += 1
        rest = lines[start:]
        whole = _fit(rest, None, None, encode, prompt_len)  # the lines the identifier may come from
        old, new = _rename(rest[:whole], rng)
        k = _fit(rest, old, new, encode, prompt_len)
        source, passage = f"{name}:{start + 1}-{start + k}", "\n".join(rest[:k])
        text = frame(passage, old, new)
        ids = encode(text)
        if (k < MIN_PASSAGE_LINES or len(ids) < MIN_FILL * prompt_len or source in seen
                or (old and not re.search(rf"\b{old}\b", passage))):
            continue
        seen.add(source)
        prompts.append(CopyPrompt(ids, text, passage, source))
    if len(prompts) < n:
        raise ValueError(f"the copy workload found {len(prompts)} of {n} different passages of runtime/*.py")
    return prompts


def _fit(lines: list[str], old: str | None, new: str | None, encode, prompt_len: int) -> int:
    """The most whole lines of `lines` whose framed prompt takes at most `prompt_len` tokens (bisected: the
    tokens grow with the lines)."""
    low, high = 0, len(lines)
    while low < high:
        mid = (low + high + 1) // 2
        if len(encode(frame("\n".join(lines[:mid]), old, new))) <= prompt_len:
            low = mid
        else:
            high = mid - 1
    return low


def _rename(lines: list[str], rng: random.Random) -> tuple[str | None, str | None]:
    """A snake_case identifier of `lines` and its camelCase spelling (None, None where there is none)."""
    names = sorted(set(re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", "\n".join(lines))))
    if not names:
        return None, None
    old = rng.choice(names)
    head, *tail = old.split("_")
    return old, head + "".join(w.capitalize() for w in tail)
