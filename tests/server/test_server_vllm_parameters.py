"""The request parameters vLLM's users and eval harnesses send beyond what PageFleet took
(issue 69), against the session's tool-calling pod (`pagefleet serve`, built-in model):
`logit_bias`, completions `echo` (with `logprobs` and `max_tokens: 0`, how
lm-evaluation-harness scores loglikelihood), `prompt_logprobs`, `min_tokens`,
`return_token_ids`, `return_tokens_as_token_ids`, `truncate_prompt_tokens`,
`stream_options.continuous_usage_stats` and `GET /version`, each with its 400s."""

import httpx
import pytest

from tests.server.server_harness import assert_error, sse_events

MODEL_NAME = "smol"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tools_pod):
    return tools_pod


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL_NAME} | body, timeout=60)


def completion(server, **body) -> dict:
    response = post(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0} | body)
    assert response.status_code == 200, response.text
    return response.json()


def chat(server, **body) -> dict:
    messages = [{"role": "user", "content": "Hi"}]
    response = post(server, "/v1/chat/completions", {"messages": messages} | body)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server, **body) -> list[dict]:
    """A streamed completion's chunks."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "stream": True} | body
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        return [e for e in sse_events(r.iter_lines()) if isinstance(e, dict)]


def tokenize(server, text: str) -> list[int]:
    response = httpx.post(
        f"{server.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False}
    )
    return response.json()["tokens"]


def test_logit_bias_bans_and_forces_tokens_on_both_endpoints(server, tools_client):
    greedy = completion(server, max_tokens=1, return_token_ids=True)["choices"][0]
    [first] = greedy["token_ids"]
    banned = completion(server, max_tokens=1, return_token_ids=True, logit_bias={first: -100})
    assert banned["choices"][0]["token_ids"] != [first]
    forced_id = tokenize(server, " banana")[0]
    forced = tools_client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0.8,
        logit_bias={str(forced_id): 100},
    )
    assert forced.choices[0].text == " banana" * 3
    answer = tools_client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=2,
        temperature=0,
        logit_bias={str(forced_id): 100},
    )
    assert answer.choices[0].message.content == " banana" * 2


@pytest.mark.parametrize(
    ("bias", "named"),
    [({"x": 1}, "token ids"), ({"1": 101}, "[-100, 100]"), ({"10000000": 1}, "token ids")],
    ids=["key", "value", "past-vocabulary"],
)
def test_bad_logit_bias_is_a_400_naming_it(server, bias, named):
    response = post(server, "/v1/completions", {"prompt": PROMPT, "logit_bias": bias})
    error = assert_error(response, 400, param="logit_bias")
    assert named in error["message"]


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt_as_lm_eval_reads_it(server):
    """lm-evaluation-harness's local-completions: token ids in, echo, logprobs, no new
    tokens; the continuation's logprob is the sum over its tokens' token_logprobs."""
    context = tokenize(server, PROMPT)
    greedy = completion(server, prompt=context, max_tokens=1, logprobs=1, return_token_ids=True)
    [answer] = greedy["choices"][0]["token_ids"]
    answer_logprob = greedy["choices"][0]["logprobs"]["token_logprobs"][0]
    body = completion(server, prompt=context + [answer], max_tokens=0, echo=True, logprobs=1)
    [choice] = body["choices"]
    logprobs = choice["logprobs"]
    assert choice["text"] == PROMPT + greedy["choices"][0]["text"]
    assert len(logprobs["tokens"]) == len(context) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    # The answer token, scored as the prompt's last token, is what sampling it gave.
    assert logprobs["token_logprobs"][-1] == pytest.approx(answer_logprob, abs=1e-3)
    top = logprobs["top_logprobs"][-1]
    assert max(top.values()) == logprobs["token_logprobs"][-1]  # greedy: lm_eval's check
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(context) + 1
    assert choice["finish_reason"] == "length"


def test_echo_with_generation_whole_and_streamed(server):
    whole = completion(server, max_tokens=3, echo=True, logprobs=0)["choices"][0]
    generated = completion(server, max_tokens=3)["choices"][0]["text"]
    assert whole["text"] == PROMPT + generated
    assert len(whole["logprobs"]["tokens"]) == len(tokenize(server, PROMPT)) + 3
    assert "".join(whole["logprobs"]["tokens"]) == whole["text"]
    events = streamed(server, max_tokens=3, echo=True)
    texts = [e["choices"][0]["text"] for e in events]
    assert texts[0].startswith(PROMPT) and "".join(texts) == whole["text"]


def test_prompt_logprobs_in_vllm_s_shape_on_both_endpoints(server):
    context = tokenize(server, PROMPT)
    [choice] = completion(server, prompt=context, max_tokens=1, prompt_logprobs=2)["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(context) and entries[0] is None
    for token_id, entry in zip(context[1:], entries[1:], strict=True):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks[:2] == [1, 2]
        assert all(v["logprob"] <= 0 and v["decoded_token"] for v in entry.values())
    reply = chat(
        server,
        max_tokens=1,
        prompt_logprobs=0,
        return_token_ids=True,
    )
    assert len(reply["prompt_logprobs"]) == len(reply["prompt_token_ids"])
    assert reply["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in reply["prompt_logprobs"][1:])


def test_min_tokens_holds_off_a_stop_token(server):
    [first] = completion(server, max_tokens=1, return_token_ids=True)["choices"][0]["token_ids"]
    stopped = completion(server, max_tokens=6, stop_token_ids=[first], return_token_ids=True)
    assert stopped["choices"][0]["token_ids"] == [first]
    held = completion(
        server, max_tokens=6, stop_token_ids=[first], min_tokens=4, return_token_ids=True
    )
    token_ids = held["choices"][0]["token_ids"]
    assert len(token_ids) >= 4 and first not in token_ids[:4]
    response = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3})
    assert "min_tokens" in assert_error(response, 400, param="min_tokens")["message"]


def test_return_token_ids_and_tokens_as_token_ids(server, tools_client):
    body = completion(
        server, max_tokens=4, return_token_ids=True, logprobs=1, return_tokens_as_token_ids=True
    )
    [choice] = body["choices"]
    assert choice["prompt_token_ids"] == tokenize(server, PROMPT)
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    detokenized = httpx.post(f"{server.base_url}/detokenize", json={"tokens": choice["token_ids"]})
    assert detokenized.json()["prompt"] == choice["text"]
    reply = chat(
        server,
        max_tokens=3,
        temperature=0,
        return_token_ids=True,
        logprobs=True,
        return_tokens_as_token_ids=True,
    )
    [choice] = reply["choices"]
    assert len(choice["token_ids"]) == reply["usage"]["completion_tokens"]
    assert len(reply["prompt_token_ids"]) == reply["usage"]["prompt_tokens"]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        f"token_id:{t}" for t in choice["token_ids"]
    ]


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(server):
    context = tokenize(server, PROMPT)
    kept = completion(server, max_tokens=1, truncate_prompt_tokens=3, return_token_ids=True)
    assert kept["choices"][0]["prompt_token_ids"] == context[-3:]
    assert kept["usage"]["prompt_tokens"] == 3
    reply = chat(
        server,
        max_tokens=1,
        truncate_prompt_tokens=2,
    )
    assert reply["usage"]["prompt_tokens"] == 2
    for bad in (0, -2, 10**6):
        response = post(
            server, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": bad}
        )
        assert_error(response, 400, param="truncate_prompt_tokens")


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = streamed(server, max_tokens=5, stream_options=options)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(e["usage"]["prompt_tokens"] == events[0]["usage"]["prompt_tokens"] for e in events)


def test_version(server):
    response = httpx.get(f"{server.base_url}/version")
    assert response.status_code == 200 and response.json()["version"]
