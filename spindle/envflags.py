"""Every command-line flag can also come from the environment, as `SPINDLE_<FLAG>`.

Kubernetes manifests (and the Helm chart) configure containers through environment variables;
flags are what a person types. One rule maps the two: `--max-num-seqs` is `SPINDLE_MAX_NUM_SEQS`.
A flag given on the command line wins over the variable, which wins over the built-in default.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Callable, Mapping

PREFIX = "SPINDLE_"
# The variables read beside the flags' (kernels/pdl.py, models/gguf_cache.py, the Redis password
# of the adapter service and the Responses store: spindle/redis_client.py, scripts/setup.sh's
# torch index).
NOT_FLAGS = frozenset({"SPINDLE_PDL", "SPINDLE_CACHE_DIR", "SPINDLE_REDIS_PASSWORD", "SPINDLE_TORCH_INDEX"})
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_name(option: str) -> str:
    return PREFIX + option.lstrip("-").upper().replace("-", "_")


def apply_env(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Make each long option of `parser` default to its environment variable, and say so in --help."""
    environ = os.environ if environ is None else environ
    # argparse has no public list of its actions; `_actions` is stable across every Python 3 release.
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if not longs or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        name = env_name(longs[0])
        if action.help is not argparse.SUPPRESS and name not in (action.help or ""):
            action.help = f"{action.help or ''} [env {name}]".strip()
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            action.default = _convert(action, raw)
        # ArgumentTypeError: how a flag's own type (serve's --stream-interval) refuses a value
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"environment variable {name}={raw!r}: {e}")
        action.required = False


def _convert(action: argparse.Action, raw: str) -> object:
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        value = raw.strip().lower()
        if value not in _TRUE | _FALSE:
            raise ValueError("expected true or false")
        on = value in _TRUE
        return on if action.const is not False else not on  # store_false flags invert
    convert = action.type or str
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+")
    values = [convert(v.strip()) for v in raw.split(",") if v.strip()] if many else [convert(raw)]
    if action.choices is not None and any(v not in action.choices for v in values):
        raise ValueError(f"expected one of {sorted(map(str, action.choices))}")
    return values if many else values[0]



def flag_variables(parser: argparse.ArgumentParser) -> set[str]:
    """The variables `apply_env` reads for `parser`'s flags."""
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    return {env_name(o) for o in flags if not o.startswith("--no-")}


def misspelt(
    parser: argparse.ArgumentParser,
    every_flag: Callable[[], set[str]],
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """A line for each `SPINDLE_` variable that is no flag of `parser` but nearly one of its
    flags' names: a misspelt variable was ignored in silence, the default served in its place.
    A shared environment may hold the other commands' variables: one that is a flag of any
    command (`every_flag()`, asked only when some variable is a near miss: it imports every
    command's module) passes without a word, as do the few read beside the flags."""
    environ = os.environ if environ is None else environ
    names = sorted(flag_variables(parser))
    near = {}
    for variable in sorted(v for v in environ if v.startswith(PREFIX) and v not in NOT_FLAGS):
        close = difflib.get_close_matches(variable, names, n=1, cutoff=0.85)
        if variable not in names and close:
            near[variable] = close[0]
    others = every_flag() if near else set()
    return [
        f"{variable} is no flag of this command and was ignored: did you mean {flag}?"
        for variable, flag in near.items()
        if variable not in others
    ]
