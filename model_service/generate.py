"""`spindle generate`: the engine in-process on a batch of requests (torch side; the dispatcher is
`spindle/cli.py`, which imports this module only when `generate` is named)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from model_service.engine.config import add_engine_args, engine_config
from model_service.errors import SpindleError

if TYPE_CHECKING:
    from model_service.engine.engine import Engine
    from model_service.engine.sampler import TokenLogprobs
    from model_service.engine.sequence import RequestOutput

_SAMPLING_FLAGS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "logprobs",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def build_parser(gen: argparse.ArgumentParser) -> argparse.ArgumentParser:
    gen.description = (
        "Generate with the engine in-process. Prompts given together run as one batch. "
        "Per-request fields in --requests override the sampling flags."
    )
    gen.epilog = (
        'examples:\n  spindle generate --chat --prompt "What is the capital of France?"\n'
        "  spindle generate --requests reqs.jsonl --json\n"
        "  each line of reqs.jsonl is one request, e.g.\n"
        '    {"prompt": "...", "max_tokens": 32, "temperature": 0.7, "seed": 1, "stop": ["\\n"]}\n'
        '    {"messages": [{"role": "user", "content": "hi"}]}\n'
        '    {"prompt_token_ids": [1, 2, 3], "logprobs": 5}\n'
        '    {"prompt": "...", "prompt_logprobs": 0, "max_tokens": 0}  (each prompt token scored)\n'
        '    {"prompt": "...", "structured_output": {"json_schema": {"type": "object"}}}\n'
        '    {"prompt": "...", "logit_bias": {"50256": -100}, "min_tokens": 8, "bad_words": ["very"]}\n'
        '  spindle generate --chat --prompt "Is water wet?" --choice yes --choice no'
    )
    gen.formatter_class = argparse.RawDescriptionHelpFormatter
    src = gen.add_argument_group("input")
    src.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    src.add_argument("--requests", metavar="FILE", help="JSON lines, one request each ('-' = stdin)")
    src.add_argument("--chat", action="store_true", help="apply the model's chat template to each --prompt")
    src.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per request, in input order (token_ids, text, finish_reason, ...)",
    )
    s = gen.add_argument_group("sampling defaults")
    s.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate per request [256]")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy [default 0]")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1] [1: off]")
    s.add_argument(
        "--top-k", type=int, default=None, help="sample from the K likeliest tokens; 0 = off [off]"
    )
    s.add_argument(
        "--min-p",
        type=float,
        default=None,
        help="drop tokens below this share of the likeliest one's probability [0: off]",
    )
    s.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="HF's: > 1 discourages tokens already in prompt or output [1: off]",
    )
    s.add_argument(
        "--presence-penalty",
        type=float,
        default=None,
        help="OpenAI's: subtracted from the logit of every token already generated [0]",
    )
    s.add_argument(
        "--frequency-penalty",
        type=float,
        default=None,
        help="OpenAI's: subtracted once per time a token was generated [0]",
    )
    s.add_argument(
        "--seed", type=int, default=None, help="the same seed and request give the same sample [random]"
    )
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="with --json: each token's logprob and the top N tokens' [off]",
    )
    s.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past end-of-sequence tokens, to --max-tokens",
    )
    so = gen.add_argument_group(
        "structured output (at most one; the output is in the language it names, docs/architecture.md)"
    ).add_mutually_exclusive_group()
    so.add_argument(
        "--json-schema", metavar="FILE", help="a JSON Schema file: the output is JSON valid under it"
    )
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", metavar="RE", help="the whole output matches this regex (Rust syntax)")
    so.add_argument(
        "--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)"
    )
    so.add_argument("--grammar", metavar="FILE", help="a Lark (llguidance) or GBNF grammar file")
    add_engine_args(gen)
    return gen


def _read_requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    defaults = {k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None}
    if args.stop:
        defaults["stop"] = args.stop
    if args.ignore_eos:
        defaults["ignore_eos"] = True
    structured = _structured_output(args)
    if structured is not None:
        defaults["structured_output"] = structured
    reqs: list[dict[str, Any]] = []
    for text in args.prompt:
        reqs.append({"messages": [{"role": "user", "content": text}]} if args.chat else {"prompt": text})
    if args.requests:
        reqs += _request_lines(args.requests)
    if not reqs:
        raise SpindleError("nothing to generate: give --prompt TEXT or --requests FILE")
    named = Counter(r["request_id"] for r in reqs if r.get("request_id") is not None)
    for rid, n in named.items():
        if n > 1:  # the one check of this process: the engine trusts its caller's ids
            raise SpindleError(f"request id {rid!r} is already in use ({n} requests name it)")
    return [{**defaults, **r} for r in reqs]


def _request_lines(path: str) -> list[dict[str, Any]]:
    """The JSON objects of the lines of `path` ('-' = stdin); a file that cannot be read is a
    SpindleError naming it (it was a FileNotFoundError traceback)."""
    try:
        stream = sys.stdin if path == "-" else open(path)  # noqa: SIM115
    except OSError as e:
        raise SpindleError(f"--requests {path}: {e.strerror}") from e
    reqs = []
    with stream:
        for n, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpindleError(f"{path}:{n}: not valid JSON: {e}") from e
            if not isinstance(obj, dict):
                raise SpindleError(f"{path}:{n}: each line must be a JSON object")
            reqs.append(obj)
    return reqs


def _structured_output(args: argparse.Namespace) -> dict[str, Any] | None:
    """The `structured_output` object the structured-output flags name (None: free text); files are
    read here, so a missing one is an error before the model loads."""
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    for kind, path in (("json_schema", args.json_schema), ("grammar", args.grammar)):
        if path is not None:
            try:
                with open(path) as f:
                    return {kind: f.read()}
            except OSError as e:
                raise SpindleError(f"--{kind.replace('_', '-')} {path}: {e.strerror}") from e
    return None


def cmd_generate(args: argparse.Namespace) -> int:
    from model_service.engine.engine import Engine

    requests = _read_requests(args)
    engine = Engine(engine_config(args))
    ids: list[str | None] = []
    errors: dict[int, str] = {}
    for i, r in enumerate(requests):
        try:
            ids.append(engine.add_request_dict(r))
        except (SpindleError, TypeError, ValueError) as e:  # a bad request fails alone
            ids.append(None)
            errors[i] = str(e)
    try:
        final, logprobs = _run(engine)
    finally:  # a tensor-parallel engine stops its workers in order and leaves its process group
        engine.executor.teardown()
    silent = []  # raw prompts answered by a stop token alone
    for i, rid in enumerate(ids):
        result = {"index": i, "error": errors[i]} if rid is None else _result(i, final[rid], logprobs[rid])
        if args.json:
            print(json.dumps(result), flush=True)
        elif "error" in result:
            print(f"[{i}] error: {result['error']}", file=sys.stderr)
        else:
            print(result["text"] if len(ids) == 1 else f"[{i}] {result['text']}", flush=True)
            if _ended_at_once(requests[i], final[rid]):
                silent.append(f"[{i}]")
    if silent:  # an empty line alone left the user guessing (an instruct model given raw text)
        which = "the prompt" if len(ids) == 1 else " ".join(silent)
        print(
            f"note: {which} ended at once on a stop token, with no text; a chat model given raw text "
            "often does: --chat applies its chat template",
            file=sys.stderr,
        )
    return 1 if errors or any(final[r].error for r in ids if r) else 0


def _ended_at_once(request: dict[str, Any], out: RequestOutput) -> bool:
    """A request without chat messages answered by a stop token alone (its id is the stop reason;
    a stop string's is the string)."""
    return "messages" not in request and isinstance(out.stop_reason, int) and len(out.token_ids) == 1


def _run(engine: Engine) -> tuple[dict[str, RequestOutput], dict[str, list[TokenLogprobs]]]:
    """Step until nothing is left: the final output of each request, and all its logprobs. A
    step's output carries only that step's (`new_logprobs`); keeping the final output alone, as
    `Engine.run_to_completion` does, lost them, so `--logprobs N` printed none."""
    final: dict[str, RequestOutput] = {}
    logprobs: dict[str, list[TokenLogprobs]] = defaultdict(list)
    prompts: dict[str, RequestOutput] = {}  # the output that carried a request's prompt logprobs
    while engine.has_unfinished():
        for out in engine.step():
            logprobs[out.request_id] += out.new_logprobs
            if out.prompt_logprobs is not None:
                prompts[out.request_id] = out
            if out.finished:
                final[out.request_id] = out
                scored = prompts.get(out.request_id, out)  # on the final output too, for `_result`
                out.prompt_token_ids, out.prompt_logprobs = scored.prompt_token_ids, scored.prompt_logprobs
    return final, logprobs


def _result(index: int, out: RequestOutput, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
    """One request's line of --json output (and what the text output prints)."""
    result: dict[str, Any] = {
        "index": index,
        "request_id": out.request_id,
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": len(out.token_ids),
    }
    if logprobs:  # one per token: its logprob and the top N as [token id, logprob]
        result["logprobs"] = [{"logprob": lp.logprob, "top_logprobs": lp.top} for lp in logprobs]
    if out.prompt_logprobs is not None:  # one per prompt token, the first null (as vLLM's)
        scored = [{"logprob": lp.logprob, "top_logprobs": lp.top} for lp in out.prompt_logprobs]
        result["prompt_logprobs"] = [None, *scored]
    if out.error:
        result["error"] = out.error
    return result


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return cmd_generate(args)
