"""`spindle` command line: a dispatcher that imports a command's module only when it is named.

Each module in `_COMMANDS` has a function that adds its flags to a parser and `run(args) -> exit
code`. The dispatcher then makes every flag of every command readable as `SPINDLE_<FLAG>` too
(`spindle.envflags`). Torch-free: `spindle chat` and `spindle gateway` never pay for torch;
`spindle generate` and `spindle serve` import it through their own modules.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType

from model_service.startup import configure_process
from spindle import envflags
from spindle.errors import SpindleError

# name -> (one-line help, module, the module's function that adds the flags to a parser).
_COMMANDS = {
    "generate": (
        "generate text for prompts, as one batch, in this process",
        "model_service.generate",
        "build_parser",
    ),
    "serve": ("run a model pod: the engine behind gRPC", "model_service.pod.server", "build_parser"),
    "gateway": ("run the gateway: one door in front of model pods", "gateway.server", "build_parser"),
    "up": (
        "start a local cluster (model pod, adapter service, gateway), answer one prompt, keep serving",
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
# The commands that run the engine in this process: their process settings come first, before
# their module imports torch (model_service/startup.py).
_ENGINE_COMMANDS = {"generate", "serve"}


def _usage() -> str:
    lines = ["usage: spindle COMMAND [--help] ...", "", "Spindle: serve LLMs with many LoRA adapters.", ""]
    lines += [f"  {name:<10} {help_}" for name, (help_, _, _) in _COMMANDS.items()]
    lines += ["", "Every flag can also be set as SPINDLE_<FLAG> (e.g. --max-num-seqs: SPINDLE_MAX_NUM_SEQS)."]
    return "\n".join(lines)


def command_parser(command: str) -> tuple[ModuleType, argparse.ArgumentParser]:
    """The module of `command` and its parser, with every flag also read from `SPINDLE_<FLAG>`:
    exactly what `spindle COMMAND` parses (the Helm chart's tests check its environment with it)."""
    help_, module_name, builder = _COMMANDS[command]
    module = importlib.import_module(module_name)
    parser = getattr(module, builder)(argparse.ArgumentParser(prog=f"spindle {command}", description=help_))
    envflags.apply_env(parser)
    return module, parser


def _every_flag_variable() -> set[str]:
    """The `SPINDLE_` variable of every flag of every command (imports every command's module)."""
    names = set()
    for _, module_name, builder in _COMMANDS.values():
        module = importlib.import_module(module_name)
        names |= envflags.flag_variables(getattr(module, builder)(argparse.ArgumentParser()))
    return names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        # asked for, it is the answer (stdout, 0); for no command at all, a usage error (stderr, 2)
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in _COMMANDS:
        print(f"{_usage()}\n\nspindle: error: unknown command {command!r}", file=sys.stderr)
        return 2
    if command in _ENGINE_COMMANDS:
        configure_process()
    module, parser = command_parser(command)
    args = parser.parse_args(rest)
    for line in envflags.misspelt(parser, _every_flag_variable):
        print(f"spindle {command}: warning: {line}", file=sys.stderr)
    args.command = command
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        return int(module.run(args) or 0)
    except SpindleError as e:
        print(f"spindle: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`spindle chat ... | head -1`): stop quietly, as a command killed by
        # SIGPIPE would (128 + 13), and point stdout at /dev/null so that the interpreter's final
        # flush of what is left in the buffer does not print a second traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
