"""Every kind of bad input gets a 4xx whose message says what is wrong, in one error shape; afterwards the
server is healthy, no KV slot is held, and only requests refused for what admission checks (prompt length,
token ids) count as `rejected`. Hostile bodies included: deep nesting, huge integers, lone surrogates,
NaN, other encodings and content types (each was a 500, or parsed as JSON, before these checks)."""

import json

import pytest

from conftest import CONTEXT

G, C = "/generate", "/v1/completions"
TOO_LONG = [5] * (CONTEXT + 76)
JSON = {"content-type": "application/json"}
DEEP = b'{"text": "hi", "sampling_params": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001
HUGE_INT = b"9" * 5000

# (method, path, body: dict to send as JSON, raw bytes (sent as JSON) or (bytes, headers), status, message
# substring, counted as rejected)
CASES = {
    # empty prompt
    "empty text": ("POST", G, {"text": ""}, 400, "empty prompt: give a non-empty `text`", False),
    "empty input_ids": ("POST", G, {"input_ids": []}, 400, "empty prompt: give at least one token", True),
    "empty completion prompt": ("POST", C, {"prompt": ""}, 400, "empty prompt", False),
    # longer than the context
    "input_ids over context": ("POST", G, {"input_ids": TOO_LONG}, 400,
                               f"prompt ({len(TOO_LONG)} tokens) + max_new_tokens (128) exceeds the context length "
                               f"of {CONTEXT} tokens", True),
    "text over context": ("POST", C, {"prompt": "a" * 2000, "max_tokens": 1}, 400,
                          f"prompt (2001 tokens) + max_new_tokens (1) exceeds the context length of {CONTEXT}", True),
    "text far over context, not tokenized": ("POST", G, {"text": "a" * (64 * CONTEXT + 1)}, 400,
                                             f"prompt text of {64 * CONTEXT + 1} characters cannot fit the context "
                                             f"length of {CONTEXT} tokens", True),
    "prompt + max tokens over context": ("POST", C, {"prompt": [7] * 200, "max_tokens": 900}, 400,
                                         "prompt (200 tokens) + max_new_tokens (900) exceeds the context length", True),
    # negative / absurd max tokens
    "negative max_new_tokens": ("POST", G, {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, 400,
                                "sampling_params.max_new_tokens: Input should be greater than or equal to 1 (got -1)",
                                False),
    "zero max_tokens": ("POST", C, {"prompt": "hi", "max_tokens": 0}, 400,
                        "max_tokens: Input should be greater than or equal to 1 (got 0)", False),
    "absurd max_new_tokens": ("POST", G, {"text": "hi", "sampling_params": {"max_new_tokens": 10**12}}, 400,
                              "sampling_params.max_new_tokens: Input should be less than or equal to 131072", False),
    # wrong types / values
    "string max_new_tokens": ("POST", G, {"text": "hi", "sampling_params": {"max_new_tokens": "16"}}, 400,
                              'sampling_params.max_new_tokens: Input should be a valid integer (got "16")', False),
    "float max_tokens": ("POST", C, {"prompt": "hi", "max_tokens": 16.5}, 400,
                         "max_tokens: Input should be a valid integer (got 16.5)", False),
    "temperature out of range": ("POST", C, {"prompt": "hi", "temperature": 3}, 400,
                                 "temperature: Input should be less than or equal to 2 (got 3)", False),
    "temperature not a number": ("POST", G, {"text": "hi", "sampling_params": {"temperature": "hot"}}, 400,
                                 'sampling_params.temperature: Input should be a valid number (got "hot")', False),
    "top_p zero": ("POST", C, {"prompt": "hi", "top_p": 0}, 400, "top_p: Input should be greater than 0", False),
    "text not a string": ("POST", G, {"text": 123}, 400, "text: Input should be a valid string (got 123)", False),
    "input_ids not ints": ("POST", G, {"input_ids": [2, "a"]}, 400,
                           'input_ids.1: Input should be a valid integer (got "a")', False),
    "token id out of vocab": ("POST", G, {"input_ids": [2, 999]}, 400, "token ids must be integers within [0, 260)",
                              True),
    "stream not a bool": ("POST", G, {"text": "hi", "stream": "yes"}, 400,
                          'stream: Input should be a valid boolean (got "yes")', False),
    "both prompts": ("POST", G, {"text": "hi", "input_ids": [2]}, 400, "give exactly one of `text` or `input_ids`",
                     False),
    "no prompt": ("POST", G, {}, 400, "give exactly one of `text` or `input_ids`", False),
    "missing completion prompt": ("POST", C, {"model": "tiny"}, 400, "prompt: Field required", False),
    "mixed prompt list": ("POST", C, {"prompt": ["a", 5]}, 400, "prompt: must be a string, a list of token ids, "
                          "or a list of either (several prompts)", False),
    "n too large": ("POST", C, {"prompt": "hi", "n": 17}, 400, "n: Input should be less than or equal to 16", False),
    "unknown field": ("POST", G, {"text": "hi", "max_tokens": 5}, 400, "max_tokens: Extra inputs are not permitted",
                      False),
    "body not an object": ("POST", G, [1, 2], 400, "body: expected a JSON object", False),
    # malformed JSON
    "truncated JSON": ("POST", G, b'{"text": "hi",', 400,
                       "malformed JSON body: Expecting property name enclosed in double quotes at line 1 column 15",
                       False),
    "empty body": ("POST", C, b"", 400, "malformed JSON body: Expecting value at line 1 column 1", False),
    "not UTF-8": ("POST", G, b'{"text": "\xff"}', 400, "malformed JSON body: not valid UTF-8", False),
    "UTF-16": ("POST", G, '{"text": "hi"}'.encode("utf-16"), 400, "malformed JSON body: not valid UTF-8", False),
    # hostile JSON
    "nested 100000 deep": ("POST", G, b"[" * 100_000 + b"]" * 100_000, 400,
                           "malformed JSON body: nested deeper than 32 levels", False),
    "nested 5000 deep in sampling_params": ("POST", G, DEEP, 400, "malformed JSON body: nested deeper than 32 levels",
                                            False),
    "5000-digit token id": ("POST", G, b'{"input_ids": [2, ' + HUGE_INT + b"]}", 400,
                            "malformed JSON body: an integer has more than 4300 digits", False),
    "5000-digit max_new_tokens": ("POST", G, b'{"text": "hi", "sampling_params": {"max_new_tokens": ' + HUGE_INT
                                  + b"}}", 400, "malformed JSON body: an integer has more than 4300 digits", False),
    "lone surrogate in text": ("POST", G, b'{"text": "a\\ud800b"}', 400,
                               "invalid Unicode in text: a lone surrogate ('\\ud800') at character 1", False),
    "lone surrogate in prompt": ("POST", C, b'{"prompt": "\\udfff"}', 400,
                                 "invalid Unicode in prompt: a lone surrogate ('\\udfff') at character 0", False),
    "lone surrogate in a key": ("POST", C, b'{"\\ud800": 1, "prompt": "hi"}', 400,
                                "invalid Unicode in a key in body: a lone surrogate", False),
    "NaN temperature": ("POST", C, b'{"prompt": "hi", "temperature": NaN}', 400,
                        "malformed JSON body: NaN is not a JSON value", False),
    "Infinity top_p": ("POST", G, b'{"text": "hi", "sampling_params": {"top_p": -Infinity}}', 400,
                       "malformed JSON body: -Infinity is not a JSON value", False),
    "overflowing float": ("POST", C, b'{"prompt": "hi", "temperature": 1e999}', 400,
                          "temperature: Input should be less than or equal to 2 (got Infinity)", False),
    "huge top_k list": ("POST", G, {"text": "hi", "sampling_params": {"top_k": [1] * 100000}}, 400,
                        "sampling_params.top_k: Input should be a valid integer", False),
    # content types: a browser page can send these cross-site without a preflight
    "no content type": ("POST", G, (b'{"text": "hi"}', {}), 415,
                        "missing Content-Type: send the body with `Content-Type: application/json`", False),
    "text/plain": ("POST", C, (b'{"prompt": "hi"}', {"content-type": "text/plain"}), 415,
                   "Content-Type 'text/plain' is not accepted", False),
    "form": ("POST", G, (b"text=hi", {"content-type": "application/x-www-form-urlencoded"}), 415,
             "Content-Type 'application/x-www-form-urlencoded' is not accepted", False),
    "multipart": ("POST", G, (b'--x\r\n\r\n{"text": "hi"}\r\n--x--', {"content-type": "multipart/form-data; boundary=x"}),
                  415, "Content-Type 'multipart/form-data' is not accepted", False),
    "latin-1 charset": ("POST", G, (b'{"text": "hi"}', {"content-type": "application/json; charset=latin-1"}), 415,
                        "charset 'latin-1' is not accepted: JSON bodies are UTF-8", False),
    # unknown model / route
    "unknown model": ("POST", C, {"model": "gpt-4", "prompt": "hi"}, 404,
                      "model 'gpt-4' not found; this server serves 'tiny'", False),
    "unknown route": ("GET", "/v2/nothing", None, 404, "no route /v2/nothing", False),
    "wrong method": ("GET", G, None, 405, "method GET not allowed on /generate", False),
}
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error",
               405: "invalid_request_error", 415: "invalid_request_error"}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_input_gets_4xx_with_message(case, live, client):
    method, path, body, status, message, counted = CASES[case]
    rejected_before = live.engine.stats.request_counts["rejected"]
    if isinstance(body, tuple):
        r = client.request(method, path, content=body[0], headers=body[1])
    elif isinstance(body, bytes):
        r = client.request(method, path, content=body, headers=JSON)
    elif body is None:
        r = client.request(method, path)
    else:
        r = client.request(method, path, content=json.dumps(body), headers=JSON)

    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert message in error["message"]
    assert error["type"] == ERROR_TYPES[status] and error["code"] == status
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    live.wait_idle_clean()  # also waits for counts posted to the engine thread
    assert live.engine.stats.request_counts["rejected"] - rejected_before == int(counted)


def test_a_good_request_still_works_after_the_bad_ones(client, live):
    raw = b'{"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}}'
    r = client.post("/generate", content=raw, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["meta"] == {
        "id": r.json()["meta"]["id"], "prompt_tokens": 3, "completion_tokens": 3, "finish_reason": "length"}
    live.wait_idle_clean()


def test_a_huge_unknown_model_name_is_not_echoed_whole(client):
    r = client.post("/v1/completions", json={"model": "m" * 3_000_000, "prompt": "hi"})
    assert r.status_code == 404 and len(r.content) < 500
    expected = f"model {'m' * 64!r}... (3000000 characters) not found; this server serves 'tiny'"
    assert r.json()["error"]["message"] == expected
