"""Every Triton launch in model_service passes each parameter its kernel has no default for.

CI has no Triton and no GPU, so a launch that misses an argument (a constexpr added to a kernel
and not to one of its callers) fails only on a GPU: MLA decode's split merge lost its `PDL`
argument that way and every DeepSeek decode with split sequences raised on CUDA for a day. This
reads the source instead: each `kernel[grid](...)` call against the `@triton.jit` definition of
that name, keyword arguments and `**pdl_args(...)` (which supplies `PDL`) counted. A launch that
also spreads another dict (`**_routing_args(...)`) cannot be read this way and is skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "model_service"
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl"}


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _kernels(trees: dict[Path, ast.Module]) -> dict[str, tuple[list[str], set[str]]]:
    """Kernel name -> (its parameters in order, those without a default)."""
    kernels = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                params = [a.arg for a in node.args.args]
                required = set(params[: len(params) - len(node.args.defaults)])
                earlier = kernels.setdefault(node.name, (params, required))
                assert earlier == (params, required), f"two kernels named {node.name}: launches are ambiguous"
    return kernels


def _launches(trees: dict[Path, ast.Module], names: set[str]) -> list[tuple[str, str, ast.Call]]:
    """(where, kernel name, call) of every `name[grid](...)` of a known kernel."""
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            func = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(func, ast.Subscript)
                and isinstance(func.value, ast.Name)
                and func.value.id in names
            ):
                found.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", func.value.id, node))
    return found


def _supplied(params: list[str], call: ast.Call) -> set[str] | None:
    """The parameters `call` supplies, or None when a spread dict hides some of them."""
    supplied = set()
    for keyword in call.keywords:
        if keyword.arg is not None:
            supplied.add(keyword.arg)
        elif isinstance(keyword.value, ast.Call) and getattr(keyword.value.func, "id", "") == "pdl_args":
            supplied.add("PDL")
        else:
            return None
    positional = len(call.args)
    if any(isinstance(arg, ast.Starred) for arg in call.args):  # a spread's length is unknown here,
        # but positional arguments fill the parameters before the first one given by name
        positional = min((params.index(name) for name in supplied if name in params), default=len(params))
    return supplied | set(params[:positional])


def _problems(trees: dict[Path, ast.Module]) -> tuple[int, list[str]]:
    """(launches read, a line for each missing or unknown argument)."""
    kernels = _kernels(trees)
    launches = _launches(trees, set(kernels))
    problems = []
    for where, name, call in launches:
        params, required = kernels[name]
        supplied = _supplied(params, call)
        if supplied is None:
            continue
        if missing := sorted(required - supplied):
            problems.append(f"{where}: {name} launched without {missing}")
        if unknown := sorted(supplied - set(params) - LAUNCH_OPTIONS):
            problems.append(f"{where}: {name} launched with unknown {unknown}")
    return len(launches), problems


def test_every_launch_supplies_its_kernels_required_parameters() -> None:
    launches, problems = _problems(_trees())
    assert launches > 30, "the reader found too few launches to mean anything"
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "source, message",
    [
        ("@triton.jit\ndef k(X, N, PDL: tl.constexpr):\n    pass\nk[(1,)](x, 4)\n", "without ['PDL']"),
        ("@triton.jit\ndef k(X, N, PDL: tl.constexpr):\n    pass\nk[(1,)](x, 4, **pdl_args(d))\n", None),
        ("@triton.jit\ndef k(X, N=2):\n    pass\nk[(1,)](x, M=3, num_warps=4)\n", "unknown ['M']"),
        ("@triton.jit\ndef k(X, N, M, B: tl.constexpr):\n    pass\nk[(1,)](*a, B=1)\n", None),
        ("@triton.jit\ndef k(X, N, M, B: tl.constexpr):\n    pass\nk[(1,)](*a, M=1)\n", "without ['B']"),
    ],
)
def test_the_reader_sees_a_missing_and_an_unknown_argument(source: str, message: str | None) -> None:
    launches, problems = _problems({PACKAGE / "example.py": ast.parse(source)})
    assert launches == 1
    assert len(problems) == (message is not None)
    assert all(message in problem for problem in problems)
