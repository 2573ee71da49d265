"""`spindle` command line.

`spindle generate` runs the engine in-process on a batch of requests; the other commands live in
their own modules and are imported only when named, so `spindle chat` does not pay for torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from model_service.errors import SpindleError

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


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from model_service.models.loader import ALIASES, DEFAULT_MODEL

    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=os.environ.get("SPINDLE_MODEL", DEFAULT_MODEL),
        help=f"alias ({', '.join(sorted(ALIASES))}), an HF checkpoint dir, or a .gguf file "
        "[env SPINDLE_MODEL; default %(default)s]",
    )
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto [default auto]")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto = float32 on CPU, bfloat16 on CUDA",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block [16]")
    g.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides memory)"
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache memory budget [CPU: 1 GiB; CUDA: --gpu-memory-utilization of free memory]",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one engine step; longer prompts are prefilled in chunks [2048]",
    )
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once [256]")
    g.add_argument("--max-model-len", type=int, default=None, help="context length [model's maximum]")
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="queue bound; beyond it new requests are refused as RESOURCE_EXHAUSTED [1024]",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of identical prompt prefixes across requests [on]",
    )
    g.add_argument(
        "--preemption-mode",
        choices=["recompute", "swap"],
        default="recompute",
        help="when KV blocks run out: free and recompute, or swap KV to host memory [recompute]",
    )
    g.add_argument(
        "--swap-space",
        type=float,
        default=4.0,
        help="GiB of host memory for swapped-out KV; past it, preemption recomputes [4]",
    )
    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="register a PEFT adapter directory under NAME (repeatable)",
    )
    lora.add_argument("--max-loras", type=int, default=4, help="adapters resident on the device (slots) [4]")
    lora.add_argument(
        "--max-cpu-loras", type=int, default=16, help="parsed adapters kept in host memory [16]"
    )
    lora.add_argument("--max-lora-rank", type=int, default=64, help="refuse adapters of a higher rank [64]")


def engine_config(args: argparse.Namespace) -> Any:
    from model_service.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_waiting_requests=args.max_waiting_requests,
        enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        swap_space_bytes=int(args.swap_space * (1 << 30)),
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        lora_modules=_lora_modules(args.lora),
    )


def _lora_modules(specs: list[str]) -> dict[str, str]:
    modules = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SpindleError(f"--lora takes NAME=DIR, got {spec!r}")
        modules[name] = path
    return modules


def _build_generate_parser(gen: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
        '    {"prompt_token_ids": [1, 2, 3], "logprobs": 5}'
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
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy [default 0]")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--repetition-penalty", type=float, default=None)
    s.add_argument("--presence-penalty", type=float, default=None)
    s.add_argument("--frequency-penalty", type=float, default=None)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--logprobs", type=int, default=None, help="return the top-N logprobs of each token")
    s.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    return gen


def _read_requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    defaults = {k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None}
    if args.stop:
        defaults["stop"] = args.stop
    if args.ignore_eos:
        defaults["ignore_eos"] = True
    reqs: list[dict[str, Any]] = []
    for text in args.prompt:
        reqs.append({"messages": [{"role": "user", "content": text}]} if args.chat else {"prompt": text})
    if args.requests:
        stream = sys.stdin if args.requests == "-" else open(args.requests)  # noqa: SIM115
        with stream:
            for n, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SpindleError(f"{args.requests}:{n}: not valid JSON: {e}") from e
                if not isinstance(obj, dict):
                    raise SpindleError(f"{args.requests}:{n}: each line must be a JSON object")
                reqs.append(obj)
    if not reqs:
        raise SpindleError("nothing to generate: give --prompt TEXT or --requests FILE")
    return [{**defaults, **r} for r in reqs]


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
    final = engine.run_to_completion()
    for i, rid in enumerate(ids):
        if rid is None:
            result: dict[str, Any] = {"index": i, "error": errors[i]}
        else:
            o = final[rid]
            result = {
                "index": i,
                "request_id": rid,
                "text": o.text,
                "token_ids": o.token_ids,
                "finish_reason": o.finish_reason,
                "prompt_tokens": o.num_prompt_tokens,
                "completion_tokens": len(o.token_ids),
            }
            if o.error:
                result["error"] = o.error
        if args.json:
            print(json.dumps(result), flush=True)
        elif "error" in result:
            print(f"[{i}] error: {result['error']}", file=sys.stderr)
        else:
            print(result["text"] if len(ids) == 1 else f"[{i}] {result['text']}", flush=True)
    return 1 if errors or any(final[r].error for r in ids if r) else 0


# name -> (one-line help, module, the module's function that adds the flags to a parser).
# Each module also has `run(args) -> exit code`.
_COMMANDS = {
    "generate": (
        "generate text for prompts, as one batch, in this process",
        "model_service.cli",
        "build_parser",
    ),
    "serve": ("run a model pod: the engine behind gRPC", "model_service.server", "build_parser"),
    "gateway": ("run the gateway: one door in front of model pods", "gateway.server", "build_parser"),
    "up": (
        "start a local cluster (model pod + gateway), answer one prompt, keep serving",
        "spindle.local",
        "build_parser",
    ),
    "chat": ("chat with a model through a gateway", "spindle.client", "build_chat_parser"),
    "complete": (
        "complete a prompt (no chat template) through a gateway",
        "spindle.client",
        "build_complete_parser",
    ),
    "models": ("list the models and adapters a gateway offers you", "spindle.client", "build_models_parser"),
    "adapters": ("register, list, delete adapters (admin API)", "adapter_service.client", "build_parser"),
    "adapter-service": ("run the adapter service", "adapter_service.server", "build_parser"),
}


def _usage() -> str:
    lines = ["usage: spindle COMMAND [--help] ...", "", "Spindle: serve LLMs with many LoRA adapters.", ""]
    lines += [f"  {name:<10} {help_}" for name, (help_, _, _) in _COMMANDS.items()]
    lines += ["", "Every flag can also be set as SPINDLE_<FLAG> (e.g. --max-num-seqs: SPINDLE_MAX_NUM_SEQS)."]
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return _build_generate_parser(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return cmd_generate(args)


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in _COMMANDS:
        print(f"{_usage()}\n\nspindle: error: unknown command {command!r}", file=sys.stderr)
        return 2
    help_, module_name, builder = _COMMANDS[command]
    module = importlib.import_module(module_name)
    parser = getattr(module, builder)(argparse.ArgumentParser(prog=f"spindle {command}", description=help_))
    args = parser.parse_args(rest)
    args.command = command
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        return int(module.run(args) or 0)
    except SpindleError as e:
        print(f"spindle: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
