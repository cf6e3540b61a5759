"""The commands that decode: generate (one prompt), chat (a conversation) and serve (the OpenAI-compatible API)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from edge.cli.app import app
from edge.cli.options import (
    DECODING,
    ModelArg,
    NoSpecOpt,
    RawOpt,
    argument_text,
    load_flags,
    load_pair,
    read_stdin,
    refuse_base_model,
    sampling_flags,
    user_errors,
)
from edge.cli.render import err, reply_stats, warning
from edge.serve.limits import BODY_TIMEOUT_S, HEAD_TIMEOUT_S
from rich.markup import escape

from edge.errors import UserError
from edge.options import MAX_PARALLEL, LoadOptions, check_max_tokens
from edge.sampling import SamplingConfig


@app.command()
@user_errors
@load_flags("pair", "target", *DECODING, "target_dtype")
@sampling_flags()
def generate(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Argument(help="the prompt ('-' reads stdin)")],
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 256,
    no_spec: NoSpecOpt = False,
    raw: RawOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    *,
    sampling: SamplingConfig,
    load: LoadOptions,
) -> None:
    """Complete one prompt, streaming the text (or one JSON object with --json)."""
    from edge.options import check_max_tokens

    check_max_tokens(max_tokens)  # before anything loads: a bad value is its one line
    text = read_stdin() if prompt == "-" else argument_text(prompt)
    import edge

    if not raw:
        refuse_base_model(load, "pass --raw to complete the prompt as-is")
    from edge.cli.repl import interruptible

    # Ctrl-C: stop reading or replying, then exit
    with load_pair(alone(load, no_spec)) as loaded, interruptible() as stopped:
        if loaded.lossless_warning and not no_spec:
            warning(loaded.lossless_warning)
        steps = edge.stream_generate(loaded, text, max_tokens=max_tokens, sampling=sampling, speculate=not no_spec,
                                     raw=raw, should_stop=stopped)
        if as_json:
            reply = edge.Generation.from_steps(steps, loaded.lossless_warning)
            print(json.dumps(reply.as_dict()))
            finish = reply.finish_reason
        else:
            for step in steps:
                sys.stdout.write(step.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            finish = step.finish_reason
            reply_stats(step)
    if finish == "interrupted":
        raise typer.Exit(130)  # as a shell reports a command stopped by Ctrl-C


@app.command()
@user_errors
@load_flags(*DECODING, pair=ModelArg)
@sampling_flags(recommended=True)
def chat(
    ctx: typer.Context,
    system: Annotated[str | None, typer.Option(help="system prompt", show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="most tokens per reply")] = 1024,
    no_spec: NoSpecOpt = False,
    *,
    sampling: dict[str, Any],
    load: LoadOptions,
) -> None:
    """Talk to a model. Piped stdin: one prompt per line, replies on stdout. Samples as the model recommends (its
    GGUF's general.sampling.*, else temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); --temperature 0 is greedy."""
    from edge.cli.repl import HISTORY_FILE, greedy_penalty, run_chat
    from edge.models.cache import cache_dir

    check_max_tokens(max_tokens)
    given = dict(sampling)
    temperature, repeat_penalty = given["temperature"], given["repeat_penalty"]
    refuse_base_model(load, "use `edge-spec generate --raw`")
    with load_pair(alone(load, no_spec)) as loaded:
        if loaded.template is None:
            raise UserError(f"{loaded.name} has no chat template (a base model): use `edge-spec generate --raw`")
        from dataclasses import replace

        from edge.sampling import chat_defaults

        defaults = chat_defaults(loaded.sampling, loaded.recommended)
        if repeat_penalty is None and temperature is not None:  # --temperature 0 alone: generate's greedy text
            given["repeat_penalty"] = greedy_penalty(temperature, defaults.repeat_penalty)
        chosen = replace(defaults, **{name: value for name, value in given.items() if value is not None})
        history = os.environ.get("EDGE_SPEC_CHAT_HISTORY") or cache_dir() / HISTORY_FILE
        system = None if system is None else argument_text(system, "the system prompt")
        run_chat(loaded, chosen, system, max_tokens, no_spec, err, Path(history), repeat_penalty is not None)


@app.command()
@user_errors
@load_flags("target", *DECODING, "target_dtype", pair=ModelArg)
def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="address to listen on; 0.0.0.0: every interface (other machines too)")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on (0: any free port)")] = 8080,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", envvar="EDGE_SPEC_API_KEY",
        help="require `Authorization: Bearer KEY` on every request but /health (or set EDGE_SPEC_API_KEY); repeat "
             "for several clients, each key then a principal of its own (docs/server.md)", show_default=False)] = None,
    api_keys_file: Annotated[Path | None, typer.Option(
        "--api-keys-file", help="a file of API keys, one a line (# starts a comment): each key a principal",
        show_default=False)] = None,
    share_replies: Annotated[bool, typer.Option(
        "--share-replies", help="with several keys, let lookup draft from every principal's earlier replies (faster "
                                "trees; a client can then learn what others were told)")] = False,
    cors_origin: Annotated[list[str] | None, typer.Option(
        "--cors-origin", help="let web pages from this origin call the API (repeat; * for any)",
        show_default=False)] = None,
    no_spec: NoSpecOpt = False,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level: debug, info, warning, error")] = "info",
    head_timeout: Annotated[float, typer.Option(
        help="seconds a connection has to send a whole request head (slow and idle clients are closed)")
                            ] = HEAD_TIMEOUT_S,
    body_timeout: Annotated[float, typer.Option(help="seconds a request's body has to arrive whole (else 408)")
                            ] = BODY_TIMEOUT_S,
    parallel: Annotated[str, typer.Option(
        help="requests decoded together: up to N at once, in one target pass for all, each with its tree where the "
             "pair keeps its drafter, else plainly (1: one at a time; auto: up to 4 where a pass moves the weights, "
             "from the drive or on a GPU, and their KV caches cost a lone request at most 10%, else 1)")] = "auto",
    *,
    load: LoadOptions,
) -> None:
    """Serve the pair over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions): one generation at
    a time with the pair's trees, or --parallel N requests decoded together (docs/server.md)."""
    from edge.serve.hosts import is_loopback
    from edge.serve.run import bind, serve, url

    if log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
        raise UserError(f"--log-level must be debug, info, warning or error (got {log_level!r})")
    keys = [*(api_key or ()), *(read_keys(api_keys_file) if api_keys_file is not None else ())]
    if any(not key.strip() for key in keys):
        raise UserError("--api-key is empty: give a key, or leave the option out")
    keys = list(dict.fromkeys(keys))
    for name, seconds in (("--head-timeout", head_timeout), ("--body-timeout", body_timeout)):
        if not 0 < seconds <= 3600:
            raise UserError(f"{name} must be more than 0 and at most 3600 seconds (got {seconds:g})")
    lanes = parallel_count(parallel)
    load = replace(load, parallel=lanes or 1)  # checked here, before the port
    sock = bind(host, port)  # a port in use is said before a load of seconds
    try:
        if not is_loopback(host):
            warning(f"listening on {host}: other machines can reach this server"
                    + ("" if keys else "; anyone who can is able to use it (add --api-key KEY)"))
        why = ""
        if not lanes:  # auto: the plan's, from the models' headers (the model named is checked on the way)
            from edge.models.loading import lanes_that_fit

            lanes, why = lanes_that_fit(alone(load, no_spec))
            load, why = replace(load, parallel=lanes), f"--parallel auto: {why}"
        with load_pair(alone(load, no_spec)) as loaded:
            loaded.shared_replies = share_replies
            if loaded.lossless_warning and not no_spec:
                warning(loaded.lossless_warning)
            if lanes == 1 and not no_spec and loaded.drafter is not None and loaded.budget == "auto":
                loaded.auto_budget()  # the pass times, measured now (once per machine) rather than in a first request
            base = url(sock, host)
            chat_note = "" if loaded.template is not None else " (a base model: /v1/completions only)"

            def ready() -> None:
                who = principals(keys, share_replies)
                trees = "each with its tree" if loaded.drafter is not None and not no_spec else "plainly"
                how = ("one generation at a time, others queue" if lanes == 1 else
                       f"up to {lanes} requests decoded together, {trees}, one pass for all; others queue")
                how += f" ({why})" if why else ""
                err.print(f"serving {escape(loaded.name)} at {base}/v1{chat_note} · {who} · {how} · Ctrl-C stops",
                          soft_wrap=True, highlight=False)

            serve(loaded, sock, api_keys=keys, cors_origins=cors_origin or (), speculate=not no_spec,
                  budget=None, log_level=log_level.lower(), ready=ready, head_timeout_s=head_timeout,
                  body_timeout_s=body_timeout, parallel=lanes)
    finally:
        sock.close()


def parallel_count(parallel: str) -> int:
    """--parallel as a count of requests; 0 for auto (the plan's lanes that fit: models.loading.lanes_that_fit)."""
    if parallel.strip().lower() == "auto":
        return 0
    try:
        count = int(parallel)
    except ValueError:
        raise UserError(f"--parallel must be a number of requests or auto (got {parallel!r})") from None
    if count < 1:
        raise UserError(f"--parallel must be 1 to {MAX_PARALLEL} or auto (got {count})")
    return count


def alone(load: LoadOptions, no_spec: bool) -> LoadOptions:
    """--no-spec: the target alone, no drafter model loaded (nor its ONNX graph built), no lookup."""
    return replace(load, drafter="none", lookup="off") if no_spec else load


def read_keys(path: Path) -> list[str]:
    """--api-keys-file: one key a line; blank lines and # comments skipped."""
    from edge.models.bench import read_text_file

    lines = read_text_file(path, "--api-keys-file").splitlines()
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise UserError(f"--api-keys-file {path} holds no key (one a line)")
    return keys


def principals(keys: list[str], shared_replies: bool) -> str:
    """Who the server tells apart, for its start line."""
    if len(keys) <= 1:
        return ("one key: every client is one principal (prompt cache and earlier replies shared)" if keys
                else "no key: every client is one principal (prompt cache and earlier replies shared)")
    shared = "; earlier replies shared (--share-replies)" if shared_replies else ""
    return f"{len(keys)} keys, each a principal with its own prompt cache and earlier replies{shared}"
