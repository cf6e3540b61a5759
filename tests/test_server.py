"""`edge-spec serve` as apps use it: a real server process on loopback, the real `openai` client, raw HTTP for what
clients do wrong. Greedy replies equal `edge-spec generate`'s; sampled ones with a seed equal plain sampling's."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest
from edge.cli.main import app
from edge.models.registry import load_registry
from typer.testing import CliRunner

from benchmarks.serve_process import ServerProcess
from tests.conftest import CHAT_PROMPTS, REPO
from tests.server_helpers import KEY, MODEL, PROMPT, SERVER_ARGS, health, open_stream, raw, request, wait_for


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(SERVER_ARGS) as running:
        yield running
    assert running.process.returncode == 130, running.log[-3000:]  # Ctrl-C, as a shell reports it: a clean stop
    assert "Traceback" not in running.log and '" 500' not in running.log, running.log[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def generate_text(*args: str) -> str:
    """`edge-spec generate ... --no-spec --json`'s text, from the model the server serves: the reference its trees
    must give (not `--budget auto`'s, which may decode plainly on llama.cpp's own settings, an f16 KV cache among
    them: on an AVX2 CPU a greedy text of SmolLM2's there differs from the bf16 cache's its trees verify on)."""
    result = CliRunner().invoke(app, ["generate", *args, "--pair", MODEL, "--no-spec", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["text"]


def chat(client: openai.OpenAI, content: str | list[dict], **kwargs) -> openai.types.chat.ChatCompletion:
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def streamed_chat(client: openai.OpenAI, content: str, **kwargs) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                 stream=True, **kwargs))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def assert_figures_add_up(figures: dict, completion_tokens: int) -> None:
    """A reply's `edge_spec` figures agree with each other and with its usage: its tokens (the stop token, if it
    ended on one, counted too) over its target passes, and rounds that were plain or a tree under some rule."""
    assert figures["new_tokens"] in (completion_tokens, completion_tokens + 1) and figures["target_passes"] >= 1
    assert figures["tokens_per_pass"] == pytest.approx(figures["new_tokens"] / figures["target_passes"], abs=1e-3)
    assert figures["plain_rounds"] + sum(figures["rule_rounds"].values()) == figures["rounds"]


def test_greedy_chat_and_completion_equal_generate(client: openai.OpenAI) -> None:
    reply = chat(client, PROMPT, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == generate_text(PROMPT, "-n", "24", "--temperature", "0")
    assert reply.choices[0].message.role == "assistant" and reply.model == MODEL
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0
    figures = reply.model_extra["edge_spec"]
    assert_figures_add_up(figures, reply.usage.completion_tokens)
    assert figures["mean_budget"] > 0
    assert {"draft_s", "verify_s"} <= figures.keys()

    # 12 tokens: SmolLM2 says more than that on the CPUs measured (on AVX2 it stops before 24)
    completion = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=12, temperature=0)
    assert completion.choices[0].text == generate_text("The sky is", "--raw", "-n", "12", "--temperature", "0")
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 12


def test_return_tokens_gives_the_replys_token_ids_whole_and_streamed(client: openai.OpenAI) -> None:
    """llama-server's `return_tokens`: the ids `generate` gives, in the choice, and streamed, spread over the chunks
    that carry their text."""
    result = CliRunner().invoke(app, ["generate", PROMPT, "-n", "24", "--temperature", "0", "--pair", MODEL, "--json"])
    expected = json.loads(result.stdout)["tokens"]
    whole = chat(client, PROMPT, max_tokens=24, temperature=0, extra_body={"return_tokens": True})
    assert whole.choices[0].model_extra["tokens"] == expected and whole.usage.completion_tokens == len(expected)
    text, chunks = streamed_chat(client, PROMPT, max_tokens=24, temperature=0, extra_body={"return_tokens": True})
    assert [t for c in chunks[1:] for t in c.choices[0].model_extra["tokens"]] == expected
    assert text == whole.choices[0].message.content
    plain = chat(client, PROMPT, max_tokens=4, temperature=0)
    assert "tokens" not in plain.choices[0].model_extra  # only when asked


def test_streamed_deltas_concatenate_to_the_whole_reply(client: openai.OpenAI) -> None:
    whole = chat(client, PROMPT, max_tokens=32, temperature=0)
    text, chunks = streamed_chat(client, PROMPT, max_tokens=32, temperature=0, stream_options={"include_usage": True})
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1

    pieces = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0,
                                       stream=True)
    whole_text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    assert "".join(c.choices[0].text for c in pieces) == whole_text.choices[0].text


def test_stop_strings_end_the_reply_before_them(client: openai.OpenAI) -> None:
    full = chat(client, "List the numbers from 1 to 10, one per line.", max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    assert "5" in text
    cut = chat(client, "List the numbers from 1 to 10, one per line.", max_tokens=40, temperature=0, stop=["5"])
    assert cut.choices[0].message.content == text[: text.index("5")] and cut.choices[0].finish_reason == "stop"
    streamed, _ = streamed_chat(client, "List the numbers from 1 to 10, one per line.", max_tokens=40,
                                temperature=0, stop=["5", "nothing like this"])
    assert streamed == cut.choices[0].message.content


def test_a_seed_gives_plain_samplings_exact_text(client: openai.OpenAI) -> None:
    """Sample-and-match (the server runs `--accept match`): with a seed the served text is the target's own plain
    sampling's with the same rule, and repeats."""
    kwargs = dict(max_tokens=24, temperature=0.8, seed=5)
    first = chat(client, PROMPT, **kwargs).choices[0].message.content
    assert chat(client, PROMPT, **kwargs).choices[0].message.content == first
    # the server's defaults for fields the request leaves out: top-k 40, top-p 0.95, min-p 0.05, no repeat penalty
    assert first == generate_text(PROMPT, "-n", "24", "--temperature", "0.8", "--seed", "5", "--top-k", "40",
                                  "--top-p", "0.95", "--min-p", "0.05", "--no-spec", "--accept", "match")


def test_a_chats_next_turn_reuses_the_cache_and_stays_lossless(client: openai.OpenAI) -> None:
    first = [{"role": "user", "content": PROMPT}]
    reply = chat(client, first, max_tokens=16, temperature=0)
    second = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
              {"role": "user", "content": "And two more?"}]
    reused = chat(client, second, max_tokens=16, temperature=0)
    assert reused.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens
    chat(client, "Something else entirely.", max_tokens=4, temperature=0)  # the caches now hold another prompt
    fresh = chat(client, second, max_tokens=16, temperature=0)
    assert fresh.usage.prompt_tokens_details.cached_tokens < reply.usage.prompt_tokens
    assert fresh.choices[0].message.content == reused.choices[0].message.content


def test_concurrent_clients_each_get_their_own_reply(client: openai.OpenAI, server: ServerProcess) -> None:
    prompts = CHAT_PROMPTS[:8]
    alone = {prompt: chat(client, prompt, max_tokens=12, temperature=0).choices[0].message.content
             for prompt in prompts}

    def one_client(index: int) -> list[tuple[str, str, str]]:
        own = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        got = []
        for turn in range(3):
            prompt = prompts[(index + turn) % len(prompts)]
            if turn == 1:
                text, chunks = streamed_chat(own, prompt, max_tokens=12, temperature=0)
                got.append((prompt, text, chunks[0].id))
            else:
                reply = chat(own, prompt, max_tokens=12, temperature=0)
                got.append((prompt, reply.choices[0].message.content, reply.id))
        return got

    with ThreadPoolExecutor(8) as pool:
        results = [item for got in pool.map(one_client, range(8)) for item in got]
    assert len(results) == 24 and len({reply_id for _, _, reply_id in results}) == 24
    for prompt, text, _ in results:
        assert text == alone[prompt], prompt
    assert health(server)["queue"] == {"running": 0, "waiting": 0}


def leave_then_be_served(client: openai.OpenAI, server: ServerProcess, connection: http.client.HTTPConnection,
                         cancelled: int) -> None:
    """The client of a running generation leaves: it is cancelled, counted so, and the next request is served at
    once, not after the 1000 tokens the other asked for."""
    connection.sock.shutdown(2)
    connection.close()
    wait_for(lambda: health(server)["requests"]["cancelled"] != cancelled, 60)
    state = health(server)
    assert state["requests"]["cancelled"] == cancelled + 1 and state["queue"]["running"] == 0
    started = time.monotonic()
    assert chat(client, PROMPT, max_tokens=8, temperature=0).choices[0].finish_reason == "length"
    assert time.monotonic() - started < 60


def test_a_client_that_leaves_stops_its_generation(client: openai.OpenAI, server: ServerProcess) -> None:
    cancelled = health(server)["requests"]["cancelled"]
    connection = open_stream(server, "Write a very long story about a dragon.", 1000)
    response = connection.getresponse()
    events = [line for line in (response.readline() for _ in range(12)) if line.startswith(b"data:")]
    assert len(events) == 6 and health(server)["queue"]["running"] == 1  # it is generating
    leave_then_be_served(client, server, connection, cancelled)


def test_a_non_streamed_client_that_leaves_stops_its_generation(client: openai.OpenAI, server: ServerProcess) -> None:
    """Not streamed: the reply is sent whole at the end, and a client that leaves before it is cancelled, counted as
    such, and the next request is served at once."""
    cancelled = health(server)["requests"]["cancelled"]
    url = urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 1000, "temperature": 0}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    wait_for(lambda: health(server)["queue"]["running"] == 1, 60)
    leave_then_be_served(client, server, connection, cancelled)


def test_a_waiting_client_that_leaves_is_skipped(server: ServerProcess) -> None:
    """Clients queue in arrival order; one that leaves while waiting is dropped from /health's count."""
    running = open_stream(server, "Tell me a long story.", 300)
    running.getresponse().readline()
    waiting = open_stream(server, "Tell me a long story.", 300)
    wait_for(lambda: health(server)["queue"]["waiting"] == 1, 30)
    assert health(server)["queue"]["waiting"] == 1
    waiting.close()
    wait_for(lambda: health(server)["queue"]["waiting"] == 0, 30)
    assert health(server)["queue"]["waiting"] == 0
    running.close()


def test_bad_requests_through_the_openai_client(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="one choice per request"):
        chat(client, PROMPT, n=2)
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, "word " * 2000)
    assert raised.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        client.completions.create(model=MODEL, prompt=["a", "b"])
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.models.list()
    assert request(server, "GET", "/v1/models", headers={"Authorization": ""})[0] == 401
    assert request(server, "GET", "/", headers={"Authorization": ""})[0] == 401  # the key guards all but /health
    assert request(server, "GET", "/")[0] == 200
    assert [model.id for model in client.models.list()] == [MODEL]
    assert health(server)["status"] == "ok"


def test_an_allowed_origin_passes_the_js_sdks_preflight_and_a_non_ascii_key_matches() -> None:
    key = "clé-ünïcode-🔑"
    with ServerProcess([MODEL, "--budget", "4", "--ctx", "512", "--cors-origin", "http://app.example",
                        "--api-key", key]) as allowed:
        status, _ = raw(allowed, "OPTIONS", "/v1/chat/completions", None, {
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-stainless-lang,x-stainless-os"})
        assert status == 200
        utf8 = f"Bearer {key}".encode().decode("latin-1")  # the header's bytes are the key's UTF-8
        status, answer = raw(allowed, "GET", "/v1/models", None, {"Authorization": utf8})
        assert status == 200 and [model["id"] for model in answer["data"]] == [MODEL]
        assert raw(allowed, "GET", "/v1/models", None, {"Authorization": "Bearer cle"})[0] == 401
        status, answer = raw(allowed, "GET", "/v1/models", None, {"Origin": "http://other.example",
                                                                  "Authorization": utf8})
        assert status == 403 and answer["error"]["code"] == "origin_not_allowed"


def test_a_base_model_serves_completions_but_not_chat() -> None:
    with ServerProcess(["gemma3-270m", "--budget", "4", "--ctx", "512"]) as base:
        client = openai.OpenAI(base_url=base.url + "/v1", api_key="none", max_retries=0, timeout=300)
        with pytest.raises(openai.BadRequestError, match="no chat template") as raised:
            client.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "Hi"}])
        assert raised.value.code == "no_chat_template"
        completion = client.completions.create(model="gemma3-270m", prompt="The sky is", max_tokens=8,
                                               temperature=0)
        assert completion.choices[0].text and completion.choices[0].finish_reason == "length"


def test_a_port_in_use_is_one_line_before_any_load(server: ServerProcess) -> None:
    port = str(urlsplit(server.url).port)
    result = CliRunner().invoke(app, ["serve", MODEL, "--port", port])
    assert result.exit_code == 1 and f"port {port} on 127.0.0.1 is in use" in result.output


def test_listening_beyond_loopback_warns() -> None:
    """The warning comes before the load; the load is stopped at once (a missing model file)."""
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "0", "--target", "/nonexistent.gguf"])
    assert result.exit_code == 1
    assert "other machines can reach this server" in result.output and "--api-key" in result.output


@pytest.mark.parametrize(("document", "section"), [("docs/server.md", "### The `openai` Python package"),
                                                   ("README.md", "## Server")])
def test_the_documented_client_example_runs(server: ServerProcess, document: str, section: str) -> None:
    """The docs' example as written, pointed at this test's server (its port, key and model: the docs name the default
    pair)."""
    text = (REPO / document).read_text(encoding="utf-8")
    example = re.search(re.escape(section) + r"\n.*?```python\n(.*?)```", text, re.DOTALL)
    assert example is not None, f"{document} has no Python example under {section}"
    code = (example.group(1).replace("http://127.0.0.1:8080", server.url).replace('api_key="none"', f'api_key="{KEY}"')
            .replace(f'model="{load_registry().default}"', f'model="{MODEL}"'))
    assert server.url in code and KEY in code and f'model="{MODEL}"' in code
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()


def test_the_url_said_for_an_address_in_brackets_is_one_a_client_can_use() -> None:
    from edge.serve.run import url

    class Bound:
        def getsockname(self) -> tuple[str, int]:
            return ("::1", 18081)

    for host in ("[::1", "[::1]", "::1"):
        assert url(Bound(), host) == "http://[::1]:18081"  # type: ignore[arg-type]
    assert url(Bound(), "0.0.0.0") == "http://127.0.0.1:18081"  # type: ignore[arg-type]
