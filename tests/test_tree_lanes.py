"""Several requests' trees verified in one target pass (runtimes/llama_cpp/tree_lanes.py): each lane's tree logits are
bit for bit those of plain decoding, whatever the other lanes ran in the same passes, and speculative replies decoded
together equal plain decoding's. On real SmolLM2 (its Q4_1 target, llama.cpp's drafter forked once a lane)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
from edge.models.pair import Pair
from edge.runtimes.llama_cpp.models import LlamaDrafter, LlamaTarget
from edge.runtimes.llama_cpp.tree_lanes import TreeLanes
from edge.serve.app import create_app
from edge.serve.worker import Worker
from starlette.testclient import TestClient

import edge
from edge.generate import Decoder
from edge.grow import GrowConfig, grow
from edge.invariance import compare
from tests.conftest import CHAT_PROMPTS, GreedyReplies, prompt_tokens

LANES = 3


@pytest.fixture
def lanes(smollm2: Pair) -> Iterator[TreeLanes]:
    assert isinstance(smollm2.target, LlamaTarget)
    made = TreeLanes(smollm2.target, LANES, 512)
    yield made
    made.close()


@pytest.fixture
def drafters(smollm2: Pair) -> Iterator[list[LlamaDrafter]]:
    assert isinstance(smollm2.drafter, LlamaDrafter)
    forks = [smollm2.drafter.fork() for _ in range(LANES)]
    yield forks
    for fork in forks:
        fork.close()


def together(lanes: TreeLanes, runs: list[Callable[[], object]]) -> list:
    """Each run in a lane's own thread at once, the lane busy meanwhile (as the server's worker runs a request)."""
    results: list = [None] * len(runs)
    errors: list[BaseException] = []

    def one(lane: int) -> None:
        lanes.busy(lane, True)
        try:
            results[lane] = runs[lane]()
        except BaseException as problem:  # raised in the test's thread below
            errors.append(problem)
        finally:
            lanes.busy(lane, False)

    threads = [threading.Thread(target=one, args=(lane,)) for lane in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    if errors:
        raise errors[0]
    return results


def test_trees_of_several_lanes_in_one_pass_are_bit_exact(smollm2: Pair, lanes: TreeLanes,
                                                          drafters: list[LlamaDrafter]) -> None:
    """Three lanes, each with a drafter-grown tree of up to 64 nodes for its own prompt, checked at once: every lane's
    tree pass and the one-token passes that check it node by node ride together with the other lanes' (seen in the
    pass counts), and every checked node's logits equal plain decoding's, bit for bit. The checks cut each lane's
    cells back again and again (the lanes keep the cells let go of: TreeLanes.remove)."""
    config = replace(GrowConfig.for_budget(63), extend_prob=None)

    def check(lane: int) -> tuple[int, float, int]:
        tokens = prompt_tokens(smollm2, CHAT_PROMPTS[lane])
        drafter = drafters[lane]
        drafter.truncate(0)
        drafter.prefill(tokens[:-1])
        tree, _ = grow(drafter, tokens[-1], config)
        assert 40 <= len(tree) <= lanes.max_tree and len(tree.leaves()) > 8
        return compare(lanes.target(lane), tree, tokens[:-1], max_paths=20)

    results = together(lanes, [lambda lane=lane: check(lane) for lane in range(LANES)])
    for checked, worst, flips in results:
        assert checked >= 30 and worst == 0.0 and flips == 0, results
    assert lanes.lane_passes >= 1.5 * lanes.passes, (lanes.passes, lanes.lane_passes)


def test_speculative_replies_decoded_together_equal_plain_decoding(smollm2: Pair, lanes: TreeLanes,
                                                                   drafters: list[LlamaDrafter],
                                                                   greedy: GreedyReplies) -> None:
    """Three greedy speculative replies (budget 32) at once, each in its lane with its own drafter: each equals the
    target's plain reply; most passes carried several lanes' trees; after them each lane holds its text but the
    newest token, in its first seq, and no branch."""
    config = replace(GrowConfig.for_budget(32), extend_prob=None)
    prompts = [prompt_tokens(smollm2, text) for text in CHAT_PROMPTS[3:3 + LANES]]
    decoders = [Decoder(lanes.target(lane), drafters[lane], config) for lane in range(LANES)]

    def decode(lane: int) -> tuple[list[int], float]:
        steps = list(decoders[lane].reply(prompts[lane], 48))
        return [step.token for step in steps if step.finish_reason is None], steps[-1].stats.tokens_per_pass

    results = together(lanes, [lambda lane=lane: decode(lane) for lane in range(LANES)])
    assert [reply for reply, _ in results] == [greedy(smollm2, tokens, 48) for tokens in prompts]
    assert lanes.lane_passes >= 1.5 * lanes.passes, (lanes.passes, lanes.lane_passes)
    assert all(tokens_per_pass > 1.5 for _, tokens_per_pass in results), results
    for lane, decoder in enumerate(decoders):
        target = lanes.target(lane)
        assert target.n_past + len(target._pending) == len(decoder.context) - 1
        assert lanes.ctx.seq_pos_max(lanes.seq(lane)) == target.n_past - 1
        assert all(lanes.ctx.seq_pos_max(lanes.seq(lane) + j) == -1 for j in range(1, lanes.seqs))


def test_a_prompt_rides_in_the_pass_of_its_first_tree(smollm2: Pair, lanes: TreeLanes, drafters: list[LlamaDrafter],
                                                      greedy: GreedyReplies) -> None:
    """A lane's prompt waits, pending, for its first round: its first token comes after one pass (the prompt's and
    its first tree's), not two, and the reply is still the target's plain one."""
    tokens = prompt_tokens(smollm2, CHAT_PROMPTS[0])
    decoder = Decoder(lanes.target(0), drafters[0], replace(GrowConfig.for_budget(16), extend_prob=None))
    passes_at_first: list[int] = []

    def reply() -> list[int]:
        replied = []
        for step in decoder.reply(tokens, 24):
            passes_at_first.append(lanes.passes)
            if step.finish_reason is None:
                replied.append(step.token)
        return replied

    assert together(lanes, [reply])[0] == greedy(smollm2, tokens, 24)
    assert passes_at_first[0] == 1
    target = lanes.target(0)
    assert target.n_past + len(target._pending) == len(decoder.context) - 1


def test_padded_tree_passes_stay_exact(smollm2: Pair, drafters: list[LlamaDrafter], greedy: GreedyReplies,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A target whose passes are padded (a Vulkan backend's 9 rows) pads the tree lanes' passes too, in a seq no lane
    owns, at the cache's tail with the trees' bodies: on the CPU the padding changes no logit, so two speculative
    replies of small trees decoded together are still the plain ones, and no padded cell stays."""
    monkeypatch.setattr(smollm2.target, "min_rows", 9)
    padded = TreeLanes(smollm2.target, 2, 512)
    try:
        prompts = [prompt_tokens(smollm2, text) for text in CHAT_PROMPTS[1:3]]
        config = replace(GrowConfig.for_budget(2), extend_prob=None)
        for drafter in drafters[:2]:
            drafter.truncate(0)
        decoders = [Decoder(padded.target(lane), drafters[lane], config) for lane in range(2)]

        def decode(lane: int) -> list[int]:
            return [step.token for step in decoders[lane].reply(prompts[lane], 16) if step.finish_reason is None]

        assert together(padded, [lambda lane=lane: decode(lane) for lane in range(2)]) == \
            [greedy(smollm2, tokens, 16) for tokens in prompts]
        assert padded.padded > 0 and padded.pad_seq == 2 * padded.seqs < padded.dead_seq
        assert padded.ctx.seq_pos_max(padded.pad_seq) == -1
    finally:
        padded.close()


A, B = "key-of-a", "key-of-b"


@pytest.fixture(scope="module")
def lanes_pair() -> Iterator[Pair]:
    """SmolLM2 with its drafter, loaded for 2 lanes as `serve --parallel 2 --budget 16` loads it."""
    with edge.load("smollm2-135m", ctx=512, gpu_layers=0, parallel=2, budget=16) as pair:
        yield pair


@pytest.fixture(scope="module")
def plain_replies(lanes_pair: Pair) -> dict[str, str]:
    """A's and B's replies from the plain lanes (`serve --parallel 2 --no-spec`)."""
    plain = Worker(lanes_pair, False, None, parallel=2)
    try:
        with TestClient(create_app(lanes_pair, plain, (A, B))) as client:
            return {key: _ask(client, key, CHAT_PROMPTS[i])["choices"][0]["text"] for i, key in enumerate((A, B))}
    finally:
        plain.close()


def test_the_server_verifies_two_principals_trees_in_one_pass(lanes_pair: Pair, plain_replies: dict) -> None:
    """`serve --parallel 2` with a drafter and two keys: A and B ask at once; each reply equals the plain one, the
    passes carried both trees, and B's cached tokens are 0 after A sent the same prompt."""
    expected = plain_replies
    worker = Worker(lanes_pair, True, 4, parallel=2)  # 4 nodes a pass in all: 2 each, so many passes to share
    assert worker.trees
    try:
        with TestClient(create_app(lanes_pair, worker, (A, B))) as client:
            results = _ask_together(client)
            assert {key: result["choices"][0]["text"] for key, result in results.items()} == expected
            lanes = worker.lanes
            assert lanes is not None and lanes.lane_passes >= 1.3 * lanes.passes, (lanes.passes, lanes.lane_passes)
            _ask(client, A, CHAT_PROMPTS[2])
            assert _ask(client, B, CHAT_PROMPTS[2])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            # the cells lanes let go of stay taken until a reset: with room for no more, the next job's start
            # empties every lane first (nothing runs), and its reply is still the plain one
            assert lanes.dead > 0
            lanes.dead_room = lanes.dead
            again = _ask(client, A, CHAT_PROMPTS[0])
            assert again["choices"][0]["text"] == expected[A] and lanes.dead == 0
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        worker.close()


def test_the_servers_auto_budget_prices_the_shared_passes(lanes_pair: Pair, plain_replies: dict) -> None:
    """`serve --parallel 2` with `--budget auto`: each lane's trees sized by LaneBudget over the pair's measured pass
    times; A's and B's replies, asked at once, are still the plain ones."""
    from edge.budget import LaneBudget

    worker = Worker(lanes_pair, True, "auto", parallel=2)
    try:
        with TestClient(create_app(lanes_pair, worker, (A, B))) as client:
            results = _ask_together(client)
            assert {key: result["choices"][0]["text"] for key, result in results.items()} == plain_replies
        budgets = [decoder.rounds.budget for _, decoder in worker._lane_decoders.values()]
        assert len(budgets) == 2 and all(isinstance(budget, LaneBudget) for budget in budgets)
        assert all(budget.chosen for budget in budgets)  # each chose its rounds' trees
    finally:
        worker.close()


def _ask_together(client: TestClient) -> dict[str, dict]:
    """A's and B's requests (the first two chat prompts), sent at once."""
    results: dict[str, dict] = {}
    threads = [threading.Thread(target=lambda k=key, p=CHAT_PROMPTS[i]: results.__setitem__(k, _ask(client, k, p)))
               for i, key in enumerate((A, B))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def _ask(client: TestClient, key: str, prompt: str) -> dict:
    answer = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"prompt": prompt, "max_tokens": 48, "temperature": 0})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_auto_prices_each_pass_for_every_request_that_rides_in_it() -> None:
    """--budget auto in lanes: where a pass computes, a request's tree shrinks as more requests share the pass; where
    it reads weights (about flat), each keeps the tree it grows alone; a seeded reply's trees do not depend on the
    others (timing held: priced alone)."""
    from edge.budget import Costs, LaneBudget

    running = [1]
    computing = Costs({1: 100, 16: 110, 64: 200, 256: 700}, {1: 3, 8: 5, 32: 10})
    alone = LaneBudget(computing, max_budget=62, sharers=lambda: running[0]).choose(63).budget
    running[0] = 4
    shared = LaneBudget(computing, max_budget=62, sharers=lambda: running[0]).choose(63).budget
    assert shared < alone
    held = LaneBudget(computing, max_budget=62, sharers=lambda: running[0])
    held.hold_timing(True)
    assert held.choose(63).budget == alone
    reading = Costs({1: 200, 256: 230}, {1: 3, 8: 5, 32: 10})
    assert LaneBudget(reading, max_budget=62, sharers=lambda: 4).choose(63).budget == \
        LaneBudget(reading, max_budget=62).choose(63).budget == 32
    # where the plan bounds a pass's nodes (33 under a memory limit), its 32 draft nodes are shared out
    bounded = LaneBudget(reading, max_budget=62, sharers=lambda: running[0], pass_room=33, lanes=4)
    assert bounded.choose(63).budget == 8
    running[0] = 1
    assert bounded.choose(63).budget == 32
    bounded.hold_timing(True)
    assert bounded.choose(63).budget == 8  # seeded: shared among every lane, whoever runs


def test_a_shared_budget_shrinks_each_tree_as_requests_join() -> None:
    """The nodes of a pass shared out among the requests that run now: 32 alone, 8 each for four, never past the
    room a lane's pass has."""
    from edge.budget import SharedBudget

    running = [1]
    budget = SharedBudget(32, lambda: running[0])
    assert budget.choose(86).budget == 32
    running[0] = 4
    assert budget.choose(86).budget == 8
    assert budget.choose(5).budget == 4 and budget.pass_s(1) is None
