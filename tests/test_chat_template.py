"""ChatTemplate renders like llama-cpp-python, and template failures become one-line UserErrors."""

import pytest

from edge.chat_template import ChatTemplate
from edge.errors import UserError

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_chatml_renders_exactly() -> None:
    template = ChatTemplate(CHATML, bos_token="<|im_start|>", eos_token="<|im_end|>")
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert template.render(MESSAGES) == expected + "<|im_start|>assistant\n"
    assert template.render(MESSAGES, add_generation_prompt=False) == expected


def test_block_whitespace_is_trimmed_and_tokens_passed() -> None:
    source = (
        "{{ bos_token }}\n{% for m in messages %}\n"
        "    {% if m['role'] == 'user' %}\n{{ m['content'] }}{{ eos_token }}\n    {% endif %}\n{% endfor %}\n"
    )
    assert ChatTemplate(source, "<s>", "</s>").render(MESSAGES) == "<s>\nHi</s>\n"


def test_strftime_now_is_available() -> None:
    assert ChatTemplate("{{ strftime_now('%Y') }}", "", "").render([]).isdigit()


def test_raise_exception_becomes_user_error() -> None:
    source = (
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
    )
    with pytest.raises(UserError, match="refused this conversation: System role not supported"):
        ChatTemplate(source, "", "").render(MESSAGES)


@pytest.mark.parametrize("source", ["{{ 1/0 }}", "{{ 'a' - 1 }}", "{{ (messages | length) // 0 }}"])
def test_an_expression_that_fails_is_one_line(source: str) -> None:
    """A template's own arithmetic or lookup error is the template's fault, said in one line (not a traceback)."""
    template = ChatTemplate(source, "", "")
    with pytest.raises(UserError, match="the model's chat template failed"):
        template.render([{"role": "user", "content": "Hi"}])


def test_syntax_error_at_load() -> None:
    with pytest.raises(UserError, match="syntax error"):
        ChatTemplate("{% for m in messages %}{{ m }}", "", "")


def test_sandbox_blocks_attribute_escape() -> None:
    template = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "", "")
    with pytest.raises(UserError, match="chat template failed"):
        template.render([])


def test_sandbox_is_immutable() -> None:
    template = ChatTemplate("{% set xs = [] %}{{ xs.append(1) }}{{ messages.clear() }}", "", "")
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(UserError):
        template.render(messages)
    assert messages == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("source, fragment", [
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses without end"),
    ("{{ 'x' * 10**14 }}", "builds a value"),
    ("{{ [1] * 100000000 }}", "builds a value"),
    ("{{ 2 ** 100000 }}", "raises to the power"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "writes more than"),
    ("{% for a in 'x' * 4000 %}{% for b in 'x' * 4000 %}{% for c in 'x' * 4000 %}{% endfor %}{% endfor %}"
     "{% endfor %}", "ran for more than"),
    ("{{ 'a'.center(50000000) }}", "pads a string"),
    ("{{ '%50000000d' % 1 }}", "formats a value 50000000 characters wide"),
    ("{{ '{:50000000}'.format(1) }}", "formats a value"),
    ("{{ '%50000000d' | format(1) }}", "formats a value"),
])
def test_a_hostile_template_is_stopped_in_bounded_time(source: str, fragment: str) -> None:
    """A template ships inside a model file: it may not spin the CPU, fill the memory or recurse forever."""
    import time

    start = time.perf_counter()
    with pytest.raises(UserError, match=f"chat template was stopped: .*{fragment}.*raw text instead") as stopped:
        ChatTemplate(source, "", "").render(MESSAGES)
    assert stopped.value.option == "raw"  # the command line says --raw
    assert time.perf_counter() - start < 5


def test_a_template_rendered_off_the_main_thread_is_stopped_in_bounded_time() -> None:
    """The server renders on worker threads: the render's own loops ask the clock there as on the main thread."""
    import threading
    import time

    source = ("{% for a in 'x' * 4000 %}{% for b in 'x' * 4000 %}{% for c in 'x' * 4000 %}{% endfor %}{% endfor %}"
              "{% endfor %}")
    outcome: dict[str, object] = {}

    def render() -> None:
        start = time.perf_counter()
        try:
            ChatTemplate(source, "", "").render(MESSAGES)
        except UserError as problem:
            outcome["error"] = str(problem)
        outcome["seconds"] = time.perf_counter() - start

    worker = threading.Thread(target=render)
    worker.start()
    worker.join(30)
    assert "ran for more than" in str(outcome.get("error")) and float(outcome["seconds"]) < 10, outcome  # type: ignore[arg-type]
    assert ChatTemplate("{{ 'ok' }}", "", "").render(MESSAGES) == "ok"  # nothing left pending on this thread


@pytest.mark.parametrize("source", [
    # a loop whose `if` rejects every item runs no body: the test itself asks the clock
    "{% for a in 'x' * 4000 %}{% for b in 'x' * 4000 if b == 'y' %}{% endfor %}{% endfor %}",
    # names a template might rebind to silence a clock it could reach: it cannot reach this one
    "{% set tick = none %}{% macro _Clock() %}{% endmacro %}{% for a in 'x' * 4000 %}{% for b in 'x' * 4000 %}"
    "{% endfor %}{% endfor %}",
])
def test_the_time_bound_holds_under_collections_and_rebound_names(source: str) -> None:
    """The bound must hold wherever Python runs code of its own mid-render: an alarm whose exception lands in a gc
    callback is swallowed there, and the render would run on unbounded (it hung a CI run). Here gc runs a Python
    callback every few allocations, as a test harness or a profiler may."""
    import gc
    import time
    from unittest.mock import patch

    from edge import chat_template

    collections = []
    gc.callbacks.append(lambda phase, info: collections.append(phase))
    threshold = gc.get_threshold()
    gc.set_threshold(10)
    start = time.perf_counter()
    try:
        with patch.object(chat_template, "MAX_SECONDS", 0.25), \
                pytest.raises(UserError, match=r"stopped: it ran for more than 0\.25 s"):
            ChatTemplate(source, "", "").render(MESSAGES)
    finally:
        gc.callbacks.pop()
        gc.set_threshold(*threshold)
    assert time.perf_counter() - start < 5 and collections
