"""Clients of one server that learn nothing about each other (docs/server.md, "Clients and principals"): with several
API keys, each key's prompt cache, tree statistics and earlier replies are its own. The server runs in this process
(the app over the session's SmolLM2 pair, its generation thread, greedy trees of 16 nodes with lookup)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from edge.models.pair import Pair
from edge.serve.app import create_app
from edge.serve.worker import Worker
from starlette.testclient import TestClient

A, B = "key-of-a", "key-of-b"
FIGURES = ("tokens_per_pass", "rounds", "tree_nodes_per_round", "lookup_rounds", "target_passes",
           "drafter_passes_per_round")


@pytest.fixture
def server(smollm2: Pair) -> Iterator[TestClient]:
    """A server of two principals; the pair starts with no decoder and no earlier reply (conftest's own_state)."""
    worker = Worker(smollm2, True, 16)
    try:
        with TestClient(create_app(smollm2, worker, (A, B))) as client:
            yield client
    finally:
        worker.close()
        smollm2.shared_replies = False


def complete(client: TestClient, key: str, prompt: str, max_tokens: int) -> dict:
    answer = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert answer.status_code == 200, answer.text
    return answer.json()


def seen_by_b(client: TestClient, pair: Pair, a_first: bool, prompt_a: str, prompt_b: str, max_tokens: int) -> dict:
    """B's reply, cached tokens and tree figures, after A asked `prompt_a` or with nobody having asked anything."""
    pair.forget_replies()
    if a_first:
        complete(client, A, prompt_a, max_tokens)
    reply = complete(client, B, prompt_b, max_tokens)
    figures = {name: reply["edge_spec"][name] for name in FIGURES}
    return {"text": reply["choices"][0]["text"], "cached": reply["usage"]["prompt_tokens_details"]["cached_tokens"],
            **figures}


def test_a_principal_cannot_read_anothers_prompt_from_the_prompt_cache(server: TestClient, smollm2: Pair) -> None:
    """A's prompt holds a PIN; B's guesses share its first digits. Before principals, B's cached_tokens counted the
    digits that matched (13 / 12 / 11 for 4821 / 4829 / 4871)."""
    secret = "Customer 1182 PIN: 4821\nAnswer OK:"
    for guess in ("4821", "4829", "4021"):
        guessed = f"Customer 1182 PIN: {guess}Z"
        with_a = seen_by_b(server, smollm2, True, secret, guessed, 2)
        assert with_a == seen_by_b(server, smollm2, False, secret, guessed, 2) and with_a["cached"] == 0, guess
    # one principal's own next turn still runs only its new tokens
    complete(server, A, secret, 2)
    assert complete(server, A, secret + " yes", 2)["usage"]["prompt_tokens_details"]["cached_tokens"] > 10


def test_a_principal_cannot_read_anothers_replies_from_lookup(server: TestClient, smollm2: Pair) -> None:
    """A is told a code; B then asks the same question. B's reply and every tree figure (lookup rounds, tokens a
    pass, nodes) are what they are when A never asked. Shared on purpose (--share-replies), B's trees draft from
    A's reply, and its figures say so."""
    question = "The vault code is QF7-ZK2-PLX9. Repeat the vault code:"
    alone = seen_by_b(server, smollm2, False, question, question, 64)
    assert seen_by_b(server, smollm2, True, question, question, 64) == alone
    smollm2.shared_replies = True
    shared = seen_by_b(server, smollm2, True, question, question, 64)
    assert shared["text"] == alone["text"]  # lossless whatever the trees drafted from
    drafted = ("lookup_rounds", "tree_nodes_per_round", "tokens_per_pass")
    assert [shared[name] for name in drafted] != [alone[name] for name in drafted], (alone, shared)


def test_one_key_or_none_is_one_principal(smollm2: Pair) -> None:
    """A server of one key (or none) keeps one prompt cache for everyone, as docs/server.md says."""
    worker = Worker(smollm2, True, 16)
    try:
        with TestClient(create_app(smollm2, worker, (A,))) as client:
            complete(client, A, "Customer 1182 PIN: 4821\nAnswer OK:", 2)
            reply = complete(client, A, "Customer 1182 PIN: 4829Z", 2)
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 10
    finally:
        worker.close()


def test_keys_come_from_flags_and_a_file_and_the_start_line_says_who_is_apart(tmp_path) -> None:
    from edge.cli.decoding import principals, read_keys

    from edge.errors import UserError

    keys = tmp_path / "keys"
    keys.write_text("# the team\nkey-of-a\n\n  key-of-b  \n")
    assert read_keys(keys) == [A, B]
    keys.write_text("# none\n")
    with pytest.raises(UserError, match="holds no key"):
        read_keys(keys)
    with pytest.raises(UserError, match="not a regular file"):
        read_keys(tmp_path)
    assert "every client is one principal" in principals([], False) == principals([], False)
    assert "one key: every client is one principal" in principals([A], False)
    assert principals([A, B], False).startswith("2 keys, each a principal")
    assert "earlier replies shared (--share-replies)" in principals([A, B], True)
