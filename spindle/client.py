"""A Generation client, and the `spindle chat`, `spindle complete`, `spindle models` commands.

Works against any server of spindle.v1.Generation: a gateway (the usual case) or one model pod.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from spindle import flagtypes
from spindle.errors import SpindleError
from spindle.tls import PLAINTEXT, TlsConfig, add_tls_args, sync_channel, tls_from_args
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc

DEFAULT_GATEWAY = "127.0.0.1:50051"
# gRPC's own target schemes (`dns:///host:port`, `unix:/path`, ...): taken as they are.
TARGET_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def gateway_target(value: str) -> str:
    """`--gateway`: a gRPC HOST:PORT. Without a port gRPC dials 443 (and reports a refusal there),
    and an HTTP URL (the OpenAI port `spindle up` prints too) fails as a "misformatted domain name":
    both are refused here, as usage errors that say what the flag wants."""
    if value.startswith(TARGET_SCHEMES):
        return value
    if "://" in value:
        raise argparse.ArgumentTypeError(
            f"{value!r} is a URL; give the gateway's gRPC HOST:PORT (e.g. {DEFAULT_GATEWAY}), "
            "not its HTTP address"
        )
    try:
        flagtypes.host_and_port(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}; give HOST:PORT (e.g. {DEFAULT_GATEWAY})") from e
    return value


gateway_target.__name__ = "HOST:PORT"


def rpc_error_line(command: str, e: grpc.RpcError, timeout: float) -> str:
    """One line for a failed call: its status and message; a bare "Deadline Exceeded" (gRPC's own,
    the client's deadline ran out) says which flag set it."""
    details = e.details()
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
        details = f"no answer within --timeout {timeout:g} s (raise it, or the service is slow)"
    return f"spindle {command}: {e.code().name}: {details}"


def finish_reason_name(reason: pb.FinishReason) -> str:
    """A finish reason as the engine, the OpenAI API and the GenAI span conventions spell it
    ("stop", "length", "abort"), not the enum's own name (FINISH_REASON_LENGTH)."""
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


@dataclass
class Completion:
    """A finished stream, gathered."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens},
        }


class Client:
    def __init__(
        self, target: str = DEFAULT_GATEWAY, api_key: str | None = None, tls: TlsConfig = PLAINTEXT
    ) -> None:
        self.channel = sync_channel(target, tls)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def generate(
        self, request: pb.GenerateRequest, timeout: float | None = None, on_text: Any = None
    ) -> Completion:
        """Run a request to the end; `on_text(delta)` sees the text as it streams."""
        out = Completion()
        for resp in self.stream(request, timeout):
            out.request_id = resp.request_id
            if resp.HasField("chunk"):
                out.token_ids.extend(resp.chunk.token_ids)
                out.text += resp.chunk.text
                if on_text is not None and resp.chunk.text:
                    on_text(resp.chunk.text)
            else:
                f = resp.final
                out.finish_reason = finish_reason_name(f.finish_reason)
                out.prompt_tokens, out.completion_tokens = f.usage.prompt_tokens, f.usage.completion_tokens
        return out

    def abort(self, request_id: str, timeout: float = 5.0) -> None:
        self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout, metadata=self.metadata)

    def list_models(self, timeout: float = 10.0) -> list[pb.ModelInfo]:
        return list(
            self.stub.ListModels(pb.ListModelsRequest(), timeout=timeout, metadata=self.metadata).models
        )


def chat_request(messages: list[dict[str, str]], **options: Any) -> pb.GenerateRequest:
    req = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]))
    return _with_options(req, **options)


def completion_request(prompt: str, **options: Any) -> pb.GenerateRequest:
    return _with_options(pb.GenerateRequest(text=prompt), **options)


def _with_options(
    req: pb.GenerateRequest,
    *,
    adapter: str | None = None,
    model: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
) -> pb.GenerateRequest:
    """Set only what was given, so everything else keeps the server's default."""
    for name, value in (("adapter", adapter), ("model", model), ("max_tokens", max_tokens), ("seed", seed)):
        if value is not None:
            setattr(req, name, value)
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if value is not None:
            setattr(req.sampling, name, value)
    req.stop.extend(stop or [])
    return req


# --- commands ----------------------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway",
        type=gateway_target,
        default=DEFAULT_GATEWAY,
        help=f"HOST:PORT of a gateway's gRPC port [{DEFAULT_GATEWAY}]",
    )
    parser.add_argument("--api-key", default=None, help="API key (prefer the environment variable)")
    parser.add_argument("--timeout", type=flagtypes.seconds, default=300.0, help="deadline in seconds [300]")
    add_tls_args(parser, server=False)


def _sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapter", default=None, help="LoRA adapter name (see `spindle models`)")
    parser.add_argument("--model", default=None, help="base model name [the gateway's]")
    parser.add_argument("--max-tokens", type=flagtypes.signed(32), default=None, help="[server default: 256]")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy [server default: 1.0]")
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling: the likeliest tokens up to this probability, in (0, 1] [server default: 1]",
    )
    parser.add_argument(
        "--top-k",
        type=flagtypes.signed(32),
        default=None,
        help="sample from the K likeliest tokens; 0 = off [server default: off]",
    )
    parser.add_argument(
        "--seed",
        type=flagtypes.signed(64),
        default=None,
        help="the same seed and request give the same sample [random]",
    )
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with text, tokens, usage")


def build_chat_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "message", nargs="*", help="the message; none = read stdin, or chat interactively on a terminal"
    )
    parser.add_argument("--system", default=None, help="a system message to start the conversation")
    _sampling(parser)
    _common(parser)
    return parser


def build_complete_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("prompt", nargs="*", help="the prompt text (no chat template); none = read stdin")
    _sampling(parser)
    _common(parser)
    return parser


def build_models_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _common(parser)
    return parser


def _options(args: argparse.Namespace) -> dict[str, Any]:
    names = ("adapter", "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
    return {n: getattr(args, n) for n in names}


def _print_stream(delta: str) -> None:
    sys.stdout.write(delta)
    sys.stdout.flush()


def _answer(client: Client, req: pb.GenerateRequest, args: argparse.Namespace) -> Completion:
    if args.json:
        out = client.generate(req, args.timeout)
        print(json.dumps(out.as_dict()), flush=True)
        return out
    try:
        out = client.generate(req, args.timeout, on_text=_print_stream)
    except KeyboardInterrupt:  # Ctrl-C mid-answer: end the line, so the shell's prompt starts on its own
        print(flush=True)
        raise
    print(flush=True)
    return out


def _given_or_stdin(words: list[str], what: str) -> str:
    """The text of the positional arguments, else all of stdin; refused when empty (an empty
    message is answered with whatever the model makes of nothing: not what a script meant)."""
    if words:
        text = " ".join(words)
    else:
        if sys.stdin.isatty():
            print(f"reading the {what} from stdin; Ctrl-D ends it", file=sys.stderr)
        text = sys.stdin.read()
    if not text.strip():
        raise SpindleError(f"the {what} is empty: give it as arguments or on stdin")
    return text


def run(args: argparse.Namespace) -> int:
    try:
        with Client(args.gateway, args.api_key, tls_from_args(args)) as client:
            if args.command == "models":
                for m in client.list_models(args.timeout):
                    kind = pb.ModelKind.Name(m.kind).removeprefix("MODEL_KIND_").lower()
                    print(f"{m.id}\t{kind}" + (f"\t(base: {m.base_model})" if m.base_model else ""))
                return 0
            if args.command == "complete":
                prompt = _given_or_stdin(args.prompt, "prompt")
                _answer(client, completion_request(prompt, **_options(args)), args)
                return 0
            return _chat(client, args)
    except grpc.RpcError as e:
        print(rpc_error_line(args.command, e, args.timeout), file=sys.stderr)
        return 1


def _chat(client: Client, args: argparse.Namespace) -> int:
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.message or not sys.stdin.isatty():
        history.append({"role": "user", "content": _given_or_stdin(args.message, "message")})
        _answer(client, chat_request(history, **_options(args)), args)
        return 0
    print("chatting; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            return 0
        if not line:
            return 0
        history.append({"role": "user", "content": line})
        out = _answer(client, chat_request(history, **_options(args)), args)
        history.append({"role": "assistant", "content": out.text})
