"""Bounded tokenization (runtime/server/prompt_bounds.py): a text that fits comes back exactly as the
tokenizer gives it; one that can never fit is refused after tokenizing about a budget's worth of text, and
on the real model eight 2,000,000-character prompts are refused without holding up an unrelated request."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from conftest import start_server

from runtime.models.tokenizer import ByteTokenizer
from runtime.server.prompt_bounds import PIECE_CHARS, encode_within


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer (one token per ASCII character), counting the characters it was asked to encode."""

    def __init__(self):
        super().__init__()
        self.chars = 0

    def encode(self, text: str) -> list[int]:
        self.chars += len(text)
        return super().encode(text)


TEXT = ("the quick brown fox jumps over the lazy dog\n" * 50_000)[:2_000_000]


@pytest.mark.parametrize("length", [10, PIECE_CHARS, PIECE_CHARS + 1, 5 * PIECE_CHARS + 17])
def test_a_text_that_fits_is_tokenized_exactly(length):
    tok = CountingTokenizer()
    text = TEXT[:length]
    assert encode_within(tok, text, budget=length + 1) == ByteTokenizer().encode(text)


def test_a_text_that_can_never_fit_is_refused_after_bounded_work():
    tok = CountingTokenizer()
    budget = 1000
    assert encode_within(tok, TEXT, budget) is None
    assert tok.chars <= PIECE_CHARS + 1  # one piece of 2,000,000 characters, not the whole text
    tok.chars = 0
    budget = 3 * PIECE_CHARS
    assert encode_within(tok, TEXT, budget) is None
    assert tok.chars <= budget + 2 * PIECE_CHARS


def test_a_text_just_over_the_budget_is_tokenized_whole_and_left_to_the_exact_check():
    text = TEXT[:4 * PIECE_CHARS]
    ids = encode_within(ByteTokenizer(), text, budget=len(text) - 5)  # within the cut slack: not refused early
    assert ids == ByteTokenizer().encode(text)


@pytest.fixture(scope="module")
def gemma_server(gemma3_gguf_path):
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    engine = Engine(EngineConfig(model="gemma3-270m", max_total_tokens=2048, swa_full_tokens_ratio=0.5,
                                 graph_batch_sizes=(1,)), progress=False)
    srv = start_server(engine, max_request_bytes=4 * 1024 * 1024)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_eight_huge_prompts_are_refused_without_stalling_an_unrelated_request(gemma_server):
    context = gemma_server.engine.context_length
    huge = ("to be or not to be that is the question " * 60_000)[:2_000_000]
    assert len(huge) < 64 * context  # past the cheap character bound: only tokenizing can tell
    small = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
    with httpx.Client(base_url=gemma_server.url, timeout=120) as c:
        c.post("/v1/completions", json=small)  # warm
        started = time.monotonic()
        c.post("/v1/completions", json=small)
        alone = time.monotonic() - started
        refusals, done = [], []

        def hostile():
            r = httpx.post(f"{gemma_server.url}/v1/completions", json={"prompt": huge, "max_tokens": 16},
                           timeout=120)
            refusals.append((r.status_code, r.json()["error"]["message"]))
            done.append(time.monotonic())

        threads = [threading.Thread(target=hostile) for _ in range(8)]
        started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(0.2)  # the bodies are uploaded and being tokenized
        probe = time.monotonic()
        r = c.post("/v1/completions", json=small)
        beside = time.monotonic() - probe
        for t in threads:
            t.join(120)
    print(f"\n1-token completion alone {alone:.2f} s, beside eight 2M-character prompts {beside:.2f} s; "
          f"refusals within {max(done) - started:.2f} s")
    assert r.status_code == 200
    assert [s for s, _ in refusals] == [400] * 8
    assert all("longer than the" in m for _, m in refusals)
    assert beside < alone + 2.0
    gemma_server.wait_idle_clean()
