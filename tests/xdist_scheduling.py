"""How `scripts/test.sh` spreads the files over its pytest-xdist workers (`--dist loadfile`: a file
runs whole on one worker): files that share a costly session fixture go to the same worker, and
the heaviest files start first.

A worker's session fixtures are its own: `spindle up` (tests/up_cluster.py) used on both workers
is two clusters started (~20 s of two shared cores each), and HF's load of SmolLM2 (the parity
oracle) costs ~15 s of CPU wherever it happens. And the suite's wall time is the busier worker's:
xdist starts the files with the most tests first, and the heaviest files hold a few tests each
(test_gateway_resume one, test_gateway_failover three), so they ran last, on one worker, while
the other had nothing left to do; started first, the light files fill in behind them and both
workers end within seconds of each other.
"""

from __future__ import annotations

import pytest

# A file -> the file whose worker runs it too, because both use a costly session fixture. The
# users of HF's SmolLM2 (`hf_smollm2`) and of `spindle up` (`spindle_up`) are one unit:
# test_prompt_logprobs.py needs both, and apart they started a second cluster or a second HF load.
_SMOLLM2_ORACLE_OR_CLUSTER = (
    "tests/test_lora.py",  # `hf_smollm2`
    "tests/test_sampling_engine.py",
    "tests/test_smollm2_parity.py",
    "tests/test_prompt_logprobs.py",  # both
    "tests/test_openai_http.py",  # `spindle_up`
    "tests/test_openai_fanout.py",
    "tests/test_openai_responses.py",
    "tests/test_quickstart.py",
    "tests/test_reasoning.py",
)
RUN_WITH = {
    **dict.fromkeys(_SMOLLM2_ORACLE_OR_CLUSTER, "tests/test_beam_search.py"),
    "tests/test_gateway_failover.py": "tests/test_gateway.py",  # `tiny_cluster`
}

# The units that keep a worker busy 25 s or more in a run of scripts/test.sh, heaviest first
# (measured on 2 shared cores); every other file follows, in name order.
HEAVY_FIRST = [
    "tests/test_beam_search.py",  # and the other users of HF's SmolLM2 and of `spindle up`
    "tests/test_gateway.py",  # and test_gateway_failover.py
    "tests/test_fuzz_rpcs.py",
    "tests/test_expert_parallel.py",
    "tests/test_model_pod.py",
    "tests/test_draft.py",
    "tests/test_speculation.py",
    "tests/test_adapter_service.py",
    "tests/test_gateway_resume.py",
    "tests/test_tensor_parallel.py",
    "tests/test_engine_fuzz.py",
]


def scope(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the file it runs with."""
    path = nodeid.split("::", 1)[0]
    return RUN_WITH.get(path, path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's own `loadfile` scheduler, with `scope` for a file and its work queue in our order:
    HEAVY_FIRST, then the other files in name order (xdist's own puts files with the most tests
    first, which left files of one slow test for the end)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            heavy = {path: i for i, path in enumerate(HEAVY_FIRST)}
            queue = sorted(self.workqueue.items(), key=lambda unit: (heavy.get(unit[0], len(heavy)), unit[0]))
            self.workqueue.clear()
            self.workqueue.update(queue)
            super()._assign_work_unit(node)

    return SharedFixtureScheduling(config, log)
