"""pytest plugin: compile every Triton kernel the interpreter tests launch for the GPU (sm_90), on
a machine without one. Run it through `scripts/compile_kernels.sh`.

Why: Triton's interpreter runs a kernel's Python, so it accepts what the compiler refuses (a name
rebound to another type inside an `if`, a launch argument the kernel lacks). Twice such a kernel
passed every CPU test and failed on its first GPU call. Here each launch goes through Triton's
front end, LLVM and ptxas for an H100/H200 target and is then dropped: nothing runs, so the
tests' own outcomes mean nothing and are not reported; the exit status says whether every kernel
reached compiled."""

from __future__ import annotations

import collections
import os
import traceback
from typing import Any

import pytest
import torch
import triton
import triton.experimental.gluon  # imported compiled, before TRITON_INTERPRET is set below
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)  # Hopper: the H100s and H200s of the device machines


class _NoDevice:
    """The driver calls a compile makes, answered for TARGET without a GPU."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self) -> Any:
        return torch.cuda

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)


driver.set_active(_NoDevice())
triton.knobs.runtime.__dict__["interpret"] = False  # kernels defined from here on are compiled ones
os.environ["TRITON_INTERPRET"] = "1"  # what the interpreter tests' skipif asks for
_errors: dict[str, set[str]] = collections.defaultdict(set)
_compiled: set[str] = set()
_run = JITFunction.run


def _compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
    name = f"{self.module}.{self.fn.__name__}"
    try:
        _run(self, *args, grid=grid, warmup=True, **kwargs)
        _compiled.add(name)
    except Exception as e:  # every kernel's failure is reported, none stops the run
        _errors[name].add(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")


JITFunction.run = _compile_only


def _kernels() -> set[str]:
    """Every `_..._kernel` defined under model_service/kernels, imported or not."""
    import importlib
    import pkgutil

    import model_service.kernels as package

    found = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, JITFunction) and attr.endswith("_kernel"):
                found.add(f"{value.module}.{value.fn.__name__}")
    return found


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    write = terminalreporter.write_line
    write(f"=== Triton kernels compiled for {TARGET.backend} sm_{TARGET.arch} (test outcomes ignored) ===")
    for name in sorted(_compiled - set(_errors)):
        write(f"ok          {name}")
    for name, errors in sorted(_errors.items()):
        write(f"FAILED      {name}")
        for error in sorted(errors):
            write("    " + error.replace("\n", "\n    "))
    for name in sorted(_kernels() - _compiled - set(_errors)):
        write(f"not reached {name}  (no interpreter test launches it)")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.exitstatus = 1 if _errors or not _compiled else 0
