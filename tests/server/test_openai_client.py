"""The official `openai` client drives the live server on loopback: completions and chat completions, whole
and streamed, stop strings, and errors raised as the client's own exception types."""

import openai
import pytest

PROMPT = "Once upon a time"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def oa(live):
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_models_list(oa):
    (model,) = oa.models.list().data
    assert model.id == "tiny"


def test_completions_create(oa, live):
    whole = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={
        "ignore_eos": True})
    (choice,) = whole.choices
    assert whole.object == "text_completion" and whole.model == "tiny" and whole.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and len(choice.text) > 0
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (1 + len(PROMPT), 24)

    chunks = list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}))
    assert len(chunks) >= 2
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    live.wait_idle_clean()


def test_completions_stop(oa, live):
    full = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    i = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full.find(full[i:i + 2]) == i)
    stopped = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0, stop=[full[i:i + 2]],
                                    extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == full[:i] and stopped.choices[0].finish_reason == "stop"
    live.wait_idle_clean()


def test_chat_completions_create(oa, live):
    whole = oa.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=20, temperature=0)
    (choice,) = whole.choices
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-") and whole.model == "tiny"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 20
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 20

    chunks = list(oa.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=20,
                                             temperature=0, stream=True, stream_options={"include_usage": True}))
    *content, usage = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == choice.message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.model_dump() == whole.usage.model_dump()
    live.wait_idle_clean()


def test_errors_raise_the_clients_exceptions(oa, live):
    with pytest.raises(openai.BadRequestError, match=r"presence_penalty: penalties are not supported") as e:
        oa.chat.completions.create(model="tiny", messages=MESSAGES, presence_penalty=0.5)
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="tools: not supported"):
        oa.chat.completions.create(model="tiny", messages=MESSAGES,
                                   tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="exceeds the context length of 1024 tokens"):
        oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4000)
    with pytest.raises(openai.BadRequestError, match="exceeds the context length"):
        oa.completions.create(model="tiny", prompt="x" * 2000, max_tokens=1)
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' not found"):
        oa.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    live.wait_idle_clean()
