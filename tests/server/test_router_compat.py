"""What the SGLang router needs of a worker (runtime/server/router_compat.py), on a live tiny server: bodies as
the router re-serialises them, registration info without a tokenizer path, load and request ids (aborts:
test_abort_authority.py)."""

from __future__ import annotations

import threading

import pytest

from conftest import sse_events

PROMPT = [2] + [(29 * i) % 256 + 4 for i in range(1, 12)]
# Exactly what sglang-router 0.3.2 forwards for {"input_ids": ..., "sampling_params": ..., "rid": ...}.
ROUTER_FIELDS = {"model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                 "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                 "return_entropy": False}
ROUTER_COMPLETION_FIELDS = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                            "skip_special_tokens": True, "return_hidden_states": False}


def generate(client, **body):
    return client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}, **body})


def test_router_generate_body_is_served_like_ours(client):
    ours = generate(client).json()
    routed = generate(client, **ROUTER_FIELDS, rid="client-7")
    assert routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == ours["output_ids"] and len(ours["output_ids"]) == 6
    assert routed.json()["meta"]["id"] == "client-7"
    assert ours["meta"]["id"].startswith("req-")


@pytest.mark.parametrize("field, value", [("return_hidden_states", True), ("background", True),
                                          ("return_bytes", True), ("return_entropy", True)])
def test_router_fields_asking_for_what_we_do_not_do_are_refused(client, field, value):
    r = generate(client, **{field: value})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"{field}: only false is supported by this server"


def test_unknown_fields_and_other_models_are_still_refused(client):
    r = generate(client, bogus=1)
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    r = generate(client, model="gemma3-270m")
    assert r.status_code == 404 and "'gemma3-270m' not found" in r.json()["error"]["message"]
    assert generate(client, model="tiny").status_code == 200


ROUTER_CHAT_FIELDS = {"continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
                      "skip_special_tokens": True, "no_stop_trim": False, "return_hidden_states": False}


def test_router_chat_fields_at_their_defaults_are_served_and_others_refused(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.0}
    ours = client.post("/v1/chat/completions", json=body).json()
    routed = client.post("/v1/chat/completions", json={**body, **ROUTER_CHAT_FIELDS})
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["message"] == ours["choices"][0]["message"]
    r = client.post("/v1/chat/completions", json={**body, **ROUTER_CHAT_FIELDS, "continue_final_message": True})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "continue_final_message: only false is supported by this server"


def test_router_completion_fields_and_request_id_header(client):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0.0, **ROUTER_COMPLETION_FIELDS}
    r = client.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "cmpl-trace-42" and r.json()["usage"]["completion_tokens"] == 5
    r = client.post("/v1/completions", json={**body, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "echo: the prompt is not echoed by this server (only false) (got true)")
    r = client.post("/v1/completions", json=body, headers={"X-Request-Id": "x" * 129})
    assert r.status_code == 400 and "at most 128" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info", "/model_info", "/get_model_info"])
def test_registration_names_the_model_and_no_tokenizer_path(client, path):
    info = client.get(path).json()
    assert info["served_model_name"] == "tiny"
    # a model_path or tokenizer_path would make the router load a tokenizer from it (a download for a name)
    assert "model_path" not in info and "tokenizer_path" not in info


def test_load_reports_requests_and_kv_tokens(client, live):
    assert client.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    seen = []
    with client.stream("POST", "/generate", json={"input_ids": PROMPT, "stream": True, "rid": "long-1",
                                                  "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen = client.get("/get_load").json()
                break
    (load,) = seen
    assert load["num_reqs"] == 1 and load["num_tokens"] >= len(PROMPT)
    live.wait_idle_clean()
