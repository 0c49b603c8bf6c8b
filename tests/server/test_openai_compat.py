"""OpenAI compatibility against the live server: the bodies client libraries send at their defaults, seeds,
log probabilities checked against the engine's logits, n choices and prompt lists, the API key, served
model names, the default token limit of a chat, and chat templates."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from runtime.core import SamplingParams
from runtime.server.chat import ChatMessage, render
from runtime.server.chat_template import ChatPrompt, model_chat_template
from runtime.server.openai_options import OpenAIOptions
from runtime.models.tokenizer import ByteTokenizer

from conftest import make_engine, sse_events, start_server

BODIES = json.loads((Path(__file__).parent / "fixtures" / "client_bodies.json").read_text())
BODIES.pop("_about")
USER = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def oa(live):
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def short_chats():
    """A server whose chats without a token limit stop after 16 tokens (--max-new-tokens-default 16)."""
    srv = start_server(make_engine(), openai=OpenAIOptions(max_new_tokens_default=16))
    yield srv
    srv.stop()


@pytest.mark.parametrize("name", list(BODIES))
def test_recorded_client_bodies_are_served(short_chats, name):
    case, live = BODIES[name], short_chats
    client = httpx.Client(base_url=live.url, timeout=60)
    body = case["body"]
    if body.get("stream"):
        with client.stream("POST", case["path"], json=body) as r:
            assert r.status_code == 200, r.read()
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        finished = [c for e in events[:-1] for c in e["choices"] if c["finish_reason"] is not None]
        assert len(finished) == 1
        if body.get("stream_options", {}).get("include_usage"):
            assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] > 0
    else:
        r = client.post(case["path"], json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert [c["index"] for c in answer["choices"]] == [0]
        assert answer["usage"]["completion_tokens"] >= 1
        if case["path"].endswith("chat/completions") and body.get("max_tokens") is None:
            assert answer["usage"]["completion_tokens"] <= 16
    client.close()
    live.wait_idle_clean()


# Every shared field at its neutral value: both endpoints must take the same body.
SHARED_NEUTRAL = {"model": "tiny", "max_tokens": 3, "temperature": 0, "top_p": 1, "top_k": -1, "n": 1, "stop": None,
                  "stream": False, "seed": 5, "ignore_eos": True, "user": "u", "store": False, "metadata": {"k": "v"},
                  "service_tier": "auto", "prompt_cache_key": "c", "safety_identifier": "s", "presence_penalty": 0.0,
                  "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {}, "best_of": 1}


def test_both_endpoints_take_the_shared_fields(client, live):
    for path, extra in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": USER})):
        r = client.post(path, json={**SHARED_NEUTRAL, **extra})
        assert r.status_code == 200, (path, r.text)
        assert r.json()["usage"]["completion_tokens"] == 3
    live.wait_idle_clean()


def _sample(oa, seed, **extra):
    return oa.completions.create(model="tiny", prompt="Once upon", max_tokens=24, temperature=1.0, seed=seed,
                                 extra_body={"ignore_eos": True}, **extra).choices[0].text


def test_seed_reproducible_with_sampling_while_others_run(oa, live):
    alone = _sample(oa, 1234)
    assert _sample(oa, 1234) == alone
    assert _sample(oa, 99) != alone  # the seed matters: 24 draws at temperature 1 from 260 tokens
    with ThreadPoolExecutor(6) as pool:  # unseeded sampling requests draw from the engine's generator meanwhile
        others = [pool.submit(_sample, oa, None) for _ in range(5)]
        seeded = pool.submit(_sample, oa, 1234)
        [f.result() for f in others]
    assert seeded.result() == alone
    live.wait_idle_clean()


def test_n_choices_draw_from_seed_plus_index(oa, live):
    many = oa.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=1.0, seed=40, n=3,
                                 extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [_sample_n(oa, 40 + i) for i in range(3)]
    assert len({c.text for c in many.choices}) > 1  # texts, not ids: two draws may decode alike
    assert many.usage.completion_tokens == 36 and many.usage.prompt_tokens == 1 + len("Once upon")
    live.wait_idle_clean()


def _sample_n(oa, seed):
    return oa.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=1.0, seed=seed,
                                 extra_body={"ignore_eos": True}).choices[0].text


def test_prompt_list_gives_prompt_major_choices(oa, client, live):
    prompts = ["Once upon", "A long time"]
    both = oa.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0, n=2,
                                 extra_body={"ignore_eos": True})
    singles = [oa.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert [(c.index, c.text) for c in both.choices] == [(0, singles[0]), (1, singles[0]), (2, singles[1]),
                                                        (3, singles[1])]
    assert both.usage.prompt_tokens == sum(1 + len(p) for p in prompts)
    assert both.usage.completion_tokens == 40

    chunks = list(oa.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == {0: singles[0], 1: singles[1]}
    live.wait_idle_clean()


def test_chat_n_streamed_matches_whole(oa, live):
    kwargs = dict(model="tiny", messages=USER, max_tokens=8, temperature=0.9, seed=3, n=2)
    whole = oa.chat.completions.create(**kwargs)
    chunks = list(oa.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    live.wait_idle_clean()


def _reference_logprobs(prompt_ids: list[int], new_tokens: int) -> torch.Tensor:
    """(new tokens, vocab) float32 log_softmax of the logits an engine with the same weights samples from."""
    engine = make_engine()
    logits: list = []
    engine.generate([prompt_ids], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), logits_out=logits)
    return torch.log_softmax(logits[0].float(), dim=-1)


def test_completion_logprobs_match_the_logits(oa, live):
    prompt = ByteTokenizer().encode("Once upon a time")
    out = oa.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    ref = _reference_logprobs(prompt, 6)  # (6, vocab)
    top = ref.topk(3, dim=-1)
    tok = ByteTokenizer()
    assert lp.tokens == [tok.decode([i], skip_special_tokens=False) for i in top.indices[:, 0].tolist()]
    assert lp.token_logprobs == pytest.approx(top.values[:, 0].tolist(), abs=1e-4)  # greedy: the top one
    for row, alternatives in enumerate(lp.top_logprobs):
        expected = {tok.decode([i], skip_special_tokens=False): v
                    for i, v in zip(top.indices[row].tolist(), top.values[row].tolist())}
        assert alternatives.keys() == expected.keys()
        assert list(alternatives.values()) == pytest.approx(list(expected.values()), abs=1e-4)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    live.wait_idle_clean()


def test_streamed_logprobs_equal_the_whole(oa, live):
    kwargs = dict(model="tiny", prompt="Once upon", max_tokens=8, temperature=0.8, seed=2, logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = oa.completions.create(**kwargs).choices[0]
    chunks = list(oa.completions.create(**kwargs, stream=True))
    streamed = [v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs and len(streamed) == 8
    assert "".join(ch.text for c in chunks for ch in c.choices) == whole.text
    live.wait_idle_clean()


def test_chat_logprobs_with_sampling_match_the_logits(oa, live):
    """Sampled (not greedy) tokens: each reported log probability is that token's, not the top one's. An
    engine with the same weights, prompt and seed draws the same tokens; its logits are the reference."""
    out = oa.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=1.0, seed=11,
                                     logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    tok = ByteTokenizer()
    prompt = tok.encode(render([ChatMessage(**USER[0])]))
    logits: list = []
    (ids,) = make_engine().generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, seed=11,
                                                              ignore_eos=True), logits_out=logits)
    ref = torch.log_softmax(logits[0].float(), dim=-1)  # (6, vocab)
    assert [c.token for c in content] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert [c.logprob for c in content] == pytest.approx([float(ref[k, i]) for k, i in enumerate(ids)], abs=1e-4)
    assert any(c.logprob < c.top_logprobs[0].logprob - 1e-6 for c in content)  # some draws were not the top one
    for k, c in enumerate(content):
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(ref[k].topk(2).values.tolist(), abs=1e-4)
        assert c.bytes == list(c.token.encode())
    live.wait_idle_clean()


# ---- options -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded():
    srv = start_server(make_engine(), openai=OpenAIOptions(served_model_names=("gemma-tiny", "tiny-alias"),
                                                           api_key="s3cret", max_new_tokens_default=7))
    yield srv
    srv.stop()


def test_api_key_guards_the_inference_routes_only(guarded):
    with httpx.Client(base_url=guarded.url, timeout=30) as c:
        for path, method, body in (("/v1/models", "GET", None), ("/v1/completions", "POST", {"prompt": "hi"}),
                                   ("/generate", "POST", {"text": "hi"})):
            r = c.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["message"].startswith("missing API key")
            r = c.request(method, path, json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    with openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="s3cret", max_retries=0) as oa:
        assert [m.id for m in oa.models.list().data] == ["gemma-tiny"]
        answer = oa.chat.completions.create(model="tiny-alias", messages=USER, extra_body={"ignore_eos": True})
        assert answer.model == "gemma-tiny"
        assert answer.usage.completion_tokens == 7  # no limit asked: --max-new-tokens-default
        with pytest.raises(openai.NotFoundError, match="model 'tiny' not found; this server serves 'gemma-tiny'"):
            oa.chat.completions.create(model="tiny", messages=USER)
    with openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="nope", max_retries=0) as oa:
        with pytest.raises(openai.AuthenticationError):
            oa.models.list()
    guarded.wait_idle_clean()


def test_chat_template_file_renders_the_prompt(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}"
                        "{% if messages|length > 2 %}{{ raise_exception('one question at a time') }}{% endif %}")
    prompt = ChatPrompt.load(str(template), "tiny", ByteTokenizer())
    srv = start_server(make_engine(), chat_prompt=prompt)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == 1 + len("[user] Name a colour.\n[assistant] ")
            r = c.post("/v1/chat/completions", json={"messages": USER * 3, "max_tokens": 2})
            assert r.status_code == 400
            assert r.json()["error"]["message"] == "messages: the chat template refused them: one question at a time"
        srv.wait_idle_clean()
    finally:
        srv.stop()


def test_the_models_own_template_is_found(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert model_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}"}))
    assert model_chat_template(tmp_path) == "{{ messages[0].content }}"
    assert model_chat_template("tiny") is None
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "gemma3")
    writer.add_chat_template("{{ bos_token }}<q>{{ messages[0].content }}</q>")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    template = model_chat_template(tmp_path / "t.gguf")
    assert template == "{{ bos_token }}<q>{{ messages[0].content }}</q>"
    prompt = ChatPrompt(template, "the model's own chat template", frozenset())
    assert prompt.render([ChatMessage(role="user", content="hi")]) == "<q>hi</q>"  # BOS: the tokenizer's job
