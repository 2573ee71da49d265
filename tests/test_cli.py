"""`spindle generate`: help, JSON output order and fields, per-request errors."""

from __future__ import annotations

import json

import pytest
import torch

import model_service.engine.engine as engine_module
from model_service.models.loader import LoadedModel, resolve_model_path
from spindle import cli
from spindle.cli import command_parser, main
from spindle.errors import SpindleError
from tests.conftest import make_engine


def test_help_explains_itself():
    """`spindle generate --help`'s text, from the parser the command builds (a process would spend
    seconds importing the engine; tests/test_quickstart.py runs `spindle --help` as a program)."""
    out = command_parser("generate")[1].format_help()
    for flag in (
        "--model",
        "--prompt",
        "--requests",
        "--chat",
        "--json",
        "--max-num-batched-tokens",
        "--enable-prefix-caching",
        "--preemption-mode",
        "--block-size",
    ):
        assert flag in out


def test_requests_file_on_a_checkpoint_without_tokenizer(tiny_llama, tmp_path, capsys):
    reqs = tmp_path / "reqs.jsonl"
    lines = [
        {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        {"prompt_token_ids": [9, 10], "max_tokens": 0},
        {"prompt": "needs a tokenizer"},
        {
            "prompt_token_ids": [11, 12, 13],
            "max_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
            "num_beams": 2,
        },
    ]
    reqs.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    rc = main(["generate", "--model", tiny_llama.name, "--requests", str(reqs), "--json", "--device", "cpu"])
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rc == 1  # some requests failed
    assert [o["index"] for o in out] == [0, 1, 2, 3]
    assert "max_tokens" in out[1]["error"] and "tokenizer" in out[2]["error"]
    engine = make_engine(tiny_llama)
    expected = engine.generate([lines[0]])[0].token_ids
    assert out[0]["token_ids"] == expected and out[0]["finish_reason"] == "length"
    assert out[0]["completion_tokens"] == 5 and out[0]["prompt_tokens"] == 4
    assert len(out[3]["token_ids"]) == 3


@pytest.fixture
def session_smollm2(smollm2, monkeypatch) -> None:
    """The command's engine gets the session's SmolLM2 rather than a second load of it (~10 s on 2
    cores): what it asks `load_model` for must be the call the `smollm2` fixture made."""

    def load_model(
        name: str, dtype: torch.dtype, device: torch.device, quantization: str = "none"
    ) -> LoadedModel:
        assert resolve_model_path(name) == resolve_model_path(smollm2.name), name
        assert (dtype, device.type, quantization) == (torch.float32, "cpu", "none")
        return smollm2

    monkeypatch.setattr(engine_module, "load_model", load_model)


def test_chat_prompts_answer(session_smollm2, capsys):
    rc = main(
        [
            "generate",
            "--chat",
            "--prompt",
            "What is the capital of France?",
            "--prompt",
            "Name a color.",
            "--json",
            "--max-tokens",
            "16",
            "--device",
            "cpu",
        ]
    )
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rc == 0
    assert "Paris" in out[0]["text"] and out[0]["finish_reason"] == "stop"
    assert len(out) == 2 and out[1]["token_ids"]


def test_a_raw_prompt_answered_by_a_stop_token_alone_says_what_chat_would_do(session_smollm2, capsys):
    """SmolLM2-Instruct answers this raw text with its end-of-turn token: the command printed an
    empty line and nothing else. A stop string that matches at once is what was asked: no note."""
    argv = ["generate", "--prompt", "Write a haiku about GPUs.", "--max-tokens", "8", "--device", "cpu"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "\n" and "ended at once on a stop token" in err and "--chat" in err
    assert main([*argv[:2], "The capital of France is", *argv[3:], "--stop", " Paris"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n" and err == ""


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["generate", "--model", "/no/such/model", "--prompt", "hi"]) == 2
    assert "neither a known alias" in capsys.readouterr().err


def test_every_engine_field_is_a_flag_and_an_environment_variable():
    import argparse
    import dataclasses

    from model_service.engine.config import EngineConfig, add_engine_args, engine_config
    from spindle import envflags

    def parse(argv, environ=None):
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        envflags.apply_env(parser, environ or {})
        return parser, engine_config(parser.parse_args(argv))

    parser, defaults = parse([])
    assert defaults == EngineConfig()  # the flags' defaults are the dataclass's
    help_ = parser.format_help()
    renamed = {"swap_space_bytes": "--swap-space", "lora_modules": "--lora"}
    for f in dataclasses.fields(EngineConfig):
        flag = renamed.get(f.name, "--" + f.name.replace("_", "-"))
        assert flag in help_ and envflags.env_name(flag) in help_, flag
    assert "smollm2" in help_  # --model lists its aliases
    argv = ["--adapter-wait-timeout-s", "2.5", "--swap-space", "0.5", "--no-enable-prefix-caching"]
    argv += ["--lora", "a=/x", "--lora", "b=/y", "--max-num-seqs", "3", "--max-model-len", "64"]
    _, config = parse(argv)
    assert config.adapter_wait_timeout_s == 2.5 and config.swap_space_bytes == 1 << 29
    assert not config.enable_prefix_caching and config.lora_modules == {"a": "/x", "b": "/y"}
    assert (config.max_num_seqs, config.max_model_len) == (3, 64)
    env = {
        "SPINDLE_ADAPTER_WAIT_TIMEOUT_S": "7",
        "SPINDLE_LORA": "c=/z",
        "SPINDLE_ENABLE_PREFIX_CACHING": "0",
    }
    _, config = parse([], env)
    assert config.adapter_wait_timeout_s == 7.0 and config.lora_modules == {"c": "/z"}
    assert not config.enable_prefix_caching
    _, config = parse(["--adapter-wait-timeout-s", "1"], env)  # the flag wins
    assert config.adapter_wait_timeout_s == 1.0


def test_bad_engine_flags_are_clear_errors(capsys):
    assert main(["generate", "--prompt", "hi", "--lora", "no-equals-sign"]) == 2
    assert "NAME=DIR" in capsys.readouterr().err


def test_structured_output_flags_become_the_requests_field(tmp_path):
    import argparse

    import pytest

    from model_service.engine.sampling_params import SamplingParams
    from model_service.errors import SpindleError
    from model_service.generate import _read_requests, build_parser

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "required": ["a"]}')
    grammar = tmp_path / "yes.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    parser = build_parser(argparse.ArgumentParser())
    for flags, expected in (
        (["--json-schema", str(schema)], {"json_schema": schema.read_text()}),
        (["--json-object"], {"json_object": True}),
        (["--regex", "[0-9]+"], {"regex": "[0-9]+"}),
        (["--choice", "yes", "--choice", "no"], {"choice": ["yes", "no"]}),
        (["--grammar", str(grammar)], {"grammar": grammar.read_text()}),
    ):
        (request,) = _read_requests(parser.parse_args(["--prompt", "hi", *flags]))
        assert request["structured_output"] == expected
        assert SamplingParams.from_dict(request).structured_output.kind == next(iter(expected))
    with pytest.raises(SystemExit):  # one kind at most
        parser.parse_args(["--prompt", "hi", "--regex", "a", "--choice", "a"])
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "a", "request_id": "x"}\n{"prompt": "b", "request_id": "x"}\n')
    with pytest.raises(SpindleError, match="request id 'x' is already in use"):
        _read_requests(parser.parse_args(["--requests", str(requests)]))
    with pytest.raises(SpindleError, match=r"no-such\.json"):
        _read_requests(parser.parse_args(["--prompt", "hi", "--json-schema", str(tmp_path / "no-such.json")]))


def test_out_of_range_engine_flags_are_refused_naming_the_flag(capsys, monkeypatch):
    """Zero or negative sizes and a memory fraction past 1 were taken as given: a traceback later
    (`--block-size 0`, `--num-kv-blocks -3`), or silently read as unset (`--num-kv-blocks 0`,
    `--max-model-len 0` ran the defaults). Each is now refused before the model loads, naming
    its flag, from the command line and from its SPINDLE_ variable, by `generate` and `serve`."""
    import asyncio

    import pytest

    from model_service.errors import ConfigError
    from model_service.pod import server

    for flags, named in (
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--block-size", "0"], "--block-size"),
        (["--num-kv-blocks", "0"], "--num-kv-blocks"),
        (["--num-kv-blocks", "-3"], "--num-kv-blocks"),
        (["--max-model-len", "0"], "--max-model-len"),
        (["--max-model-len", "-5"], "--max-model-len"),
        (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes"),
        (["--max-lora-rank", "0"], "--max-lora-rank"),
        (["--max-loras", "-1"], "--max-loras"),
    ):
        assert main(["generate", "--prompt", "hi", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith(f"spindle: error: {named} ") and "Traceback" not in err, err
    monkeypatch.setenv("SPINDLE_MAX_NUM_SEQS", "0")
    assert main(["generate", "--prompt", "hi"]) == 2
    assert "--max-num-seqs must be at least 1, got 0" in capsys.readouterr().err
    args = command_parser("serve")[1].parse_args(["--port", "0", "--control-port", "0"])
    with pytest.raises(ConfigError, match="--max-num-seqs"):  # before any port is taken
        asyncio.run(server.serve(args))


def test_a_pod_that_cannot_load_its_model_says_why_in_one_line(caplog, monkeypatch):
    """`spindle serve --model /no/such/dir` logged the ModelLoadError with its whole traceback; the
    message alone says what to fix. The pod still exits 1 (Kubernetes restarts it), its exit
    bounded as the gateway's and the adapter service's are (`serving.exit_if_stuck`: the pod had
    none, so a stuck exit waited for Kubernetes' SIGKILL and left no trace)."""
    import asyncio
    import logging

    from model_service.pod import server
    from spindle import serving

    bounds = []
    monkeypatch.setattr(serving, "exit_if_stuck", lambda seconds, what: bounds.append((seconds, what)))

    args = command_parser("serve")[1].parse_args(
        ["--model", "/no/such/model", "--host", "127.0.0.1", "--port", "0", "--control-port", "0",
         "--metrics-port", "0", "--http-port", "0"]
    )  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="spindle.serve"):
        assert asyncio.run(server.serve(args)) == 1
    (record,) = [r for r in caplog.records if "could not load the model" in r.getMessage()]
    assert "neither a known alias" in record.getMessage() and record.exc_info is None
    assert bounds == [(args.drain_timeout + 10.0, "the model pod")]


def test_a_requests_file_or_device_that_cannot_be_used_is_one_line(tmp_path, capsys, monkeypatch):
    """`--requests` naming a missing file or a directory, and `--device` naming a device torch does
    not know or this host lacks, were tracebacks (FileNotFoundError, RuntimeError, torch's
    AssertionError "Torch not compiled with CUDA enabled"); each is now one line and exit 2."""
    import torch

    for argv, said in (
        (["--requests", str(tmp_path / "no-such.jsonl")], "--requests"),
        (["--requests", str(tmp_path)], "Is a directory"),
        (["--prompt", "hi", "--device", "tpu"], "--device must be cpu, cuda, cuda:N or auto, got 'tpu'"),
    ):
        assert main(["generate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("spindle: error: ") and said in err and "Traceback" not in err, err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "--prompt", "hi", "--device", "cuda"]) == 2
    assert "--device cuda: this host has no CUDA device" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["generate", "--prompt", "hi", "--device", "cuda:2"]) == 2
    assert "--device cuda:2: this host has 2 CUDA devices" in capsys.readouterr().err


def test_a_lora_name_given_twice_is_refused(capsys):
    """`--lora a=/x --lora a=/y` kept /y alone and said nothing: the weights served under `a` were
    not the ones the first flag named."""
    assert main(["generate", "--prompt", "hi", "--lora", "a=/x", "--lora", "a=/y"]) == 2
    assert "--lora a is given twice (/x and /y)" in capsys.readouterr().err


def test_a_refused_environment_value_is_a_usage_error_for_every_flag_type(capsys):
    """A flag whose own type refuses a value with argparse's ArgumentTypeError (`serve
    --stream-interval`) gave a traceback when the value came from SPINDLE_STREAM_INTERVAL, which
    a Kubernetes manifest sets; the command line's usage error is what the variable gets now."""
    import pytest

    from spindle import envflags

    parser = command_parser("serve")[1]
    with pytest.raises(SystemExit) as exit_:
        envflags.apply_env(parser, {"SPINDLE_STREAM_INTERVAL": "0"})
    assert exit_.value.code == 2
    assert "SPINDLE_STREAM_INTERVAL='0': must be at least 1, got 0" in capsys.readouterr().err


def test_a_misspelt_environment_variable_is_named_with_the_flag_it_nearly_is(capsys, monkeypatch):
    """SPINDLE_MAX_NUM_SEQ (no S) was ignored in silence and the default served; a variable near
    one of the command's flags is now named with it. Other commands' variables (SPINDLE_PODS_DNS,
    SPINDLE_TIMEOUT: near serve's SPINDLE_SEND_TIMEOUT) and the few read beside the flags pass."""
    from spindle import envflags

    environ = {
        "SPINDLE_MAX_NUM_SEQ": "4", "SPINDLE_MAX_NUM_SEQS": "8", "SPINDLE_PDL": "1",
        "SPINDLE_PODS_DNS": "x", "SPINDLE_TIMEOUT": "3", "SPINDLE_GATEWY": "x", "HOME": "/",
    }  # fmt: skip
    lines = envflags.misspelt(command_parser("serve")[1], cli._every_flag_variable, environ)
    assert len(lines) == 1 and lines[0].startswith("SPINDLE_MAX_NUM_SEQ is no flag of this command")
    assert lines[0].endswith("did you mean SPINDLE_MAX_NUM_SEQS?")
    monkeypatch.setenv("SPINDLE_GATEWY", "127.0.0.1:1")
    assert main(["chat", "--gateway", "127.0.0.1:1", "--timeout", "2", "hi"]) != 0
    assert "spindle chat: warning: SPINDLE_GATEWY is no flag of this command" in capsys.readouterr().err


def test_ports_counts_and_intervals_out_of_range_are_usage_errors(capsys, monkeypatch):
    """`spindle gateway --port 70000` listened on 4464 (gRPC keeps the low 16 bits) and `--port -1`
    on 65535; `--health-interval 0` polled every pod in a busy loop; `--max-attempts 0` tried no
    pod. Each is now argparse's usage error naming the flag, on the command line and from its
    SPINDLE_ variable, for every service's port and the gateway's and adapter service's knobs."""
    import pytest

    from spindle import flagtypes

    cases = {
        "serve": [["--port", "70000"], ["--control-port", "-1"], ["--metrics-port", "65536"],
                  ["--http-port", "-1"], ["--health-port", "99999"], ["--stream-interval", "0"],
                  ["--drain-timeout", "-1"], ["--engine-stall-timeout", "0"], ["--send-timeout", "-1"]],
        "gateway": [["--port", "70000"], ["--health-interval", "0"], ["--health-timeout", "-1"],
                    ["--discovery-interval", "0"], ["--failure-threshold", "0"], ["--max-attempts", "0"],
                    ["--placement-timeout", "0"], ["--drain-timeout", "-0.5"], ["--send-timeout", "nan"]],
        "adapter-service": [["--port", "-1"], ["--metrics-port", "70000"], ["--poll-interval", "0"],
                            ["--max-replicas", "0"]],
        "up": [["--gateway-port", "70000"], ["--pod-port", "-1"], ["--startup-timeout", "0"]],
    }  # fmt: skip
    for command, flag_sets in cases.items():
        parser = command_parser(command)[1]
        for flag, value in flag_sets:
            with pytest.raises(SystemExit) as exit_:
                parser.parse_args([flag, value])
            assert exit_.value.code == 2
            assert f"argument {flag}: " in capsys.readouterr().err, (command, flag)
    monkeypatch.setenv("SPINDLE_HEALTH_INTERVAL", "0")
    with pytest.raises(SystemExit):
        command_parser("gateway")
    assert "SPINDLE_HEALTH_INTERVAL='0': must be more than 0 seconds" in capsys.readouterr().err
    assert flagtypes.port("0") == 0 and flagtypes.port("65535") == 65535  # 0 = a free port, or off
    assert flagtypes.seconds_or_none("0") == 0.0  # a drain that waits for nothing


def test_every_flag_of_every_command_says_what_it_means():
    """`spindle generate --help` listed --max-tokens, --top-p, --seed, --ignore-eos ... and `chat`
    --top-p, --top-k, --seed with nothing but their environment variable."""
    import argparse

    from spindle import cli

    for command in cli._COMMANDS:
        parser = command_parser(command)[1]
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                meaning = (action.help or "").split("[env ")[0].strip()
                assert meaning, f"spindle {command} {action.option_strings[0]} has no help"


def test_logprobs_flag_prints_each_tokens_logprobs_as_hf_computes_them(tiny_llama, tmp_path, capsys):
    """`spindle generate --logprobs N --json` printed no logprobs at all: the command kept each
    request's final step output, which carries only that step's. Now one entry per token, checked
    against transformers' log-softmax of the same checkpoint."""
    import transformers

    reqs = tmp_path / "reqs.jsonl"
    prompt = [5, 6, 7, 8]
    reqs.write_text(json.dumps({"prompt_token_ids": prompt, "ignore_eos": True}) + "\n")
    argv = ["generate", "--model", tiny_llama.name, "--requests", str(reqs), "--json", "--device", "cpu"]
    assert main([*argv, "--logprobs", "2", "--max-tokens", "4"]) == 0
    (out,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(out["logprobs"]) == len(out["token_ids"]) == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama.name, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out["token_ids"]])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, dim=-1)
    for row, token, entry in zip(expected, out["token_ids"], out["logprobs"], strict=True):
        assert abs(entry["logprob"] - row[token].item()) < 1e-4
        top = row.topk(2)
        assert [t for t, _ in entry["top_logprobs"]] == top.indices.tolist()
        assert all(
            abs(lp - v) < 1e-4 for (_, lp), v in zip(entry["top_logprobs"], top.values.tolist(), strict=True)
        )
    assert main([*argv, "--max-tokens", "2"]) == 0  # not asked: not printed
    assert "logprobs" not in json.loads(capsys.readouterr().out)


def test_gateway_settings_that_cannot_work_are_refused_naming_the_flag(tmp_path):
    """`--api-keys-file` missing or empty and `--pods-dns nohost` were tracebacks; `--pods notaport`
    was taken, and the gateway health-checked an address that is no pod forever. Each is now a
    ConfigError naming its flag (one line from `spindle gateway`, exit 2) before anything listens."""
    import asyncio

    import pytest

    from gateway import server as gateway_server
    from spindle.errors import ConfigError

    empty = tmp_path / "keys"
    empty.write_text("")
    base = ["--host", "127.0.0.1", "--port", "0", "--http-port", "0"]
    for flags, said in (
        (["--pods", "a:1", "--api-keys-file", str(tmp_path / "none")], "--api-keys-file .*No such file"),
        (["--pods", "a:1", "--api-keys-file", str(empty)], "--api-keys-file: .*no API keys found"),
        (["--pods-dns", "nohost", "--allow-unauthenticated"], "--pods-dns wants HOST:PORT, got 'nohost'"),
        (["--pods", "a:1,notaport", "--allow-unauthenticated"], "--pods wants HOST:PORT, got 'notaport'"),
        (["--pods", "a:99999", "--allow-unauthenticated"], "--pods wants HOST:PORT"),
    ):
        args = command_parser("gateway")[1].parse_args([*base, *flags])
        with pytest.raises(ConfigError, match=said):
            asyncio.run(gateway_server.start(args))


def test_server_settings_in_conflict_are_usage_errors_not_failed_runs(tmp_path, capfd):
    """`gateway` without --pods or API keys, `adapter-service` with --pods and --pods-dns, and a
    --control-token-file that cannot be read exited 1 (a SystemExit message), the code of a failed
    run: settings to fix, as every other setting's refusal, are exit 2."""
    local = ["--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--allow-unauthenticated"]
    token = ["--control-token-file", str(tmp_path / "no")]
    for argv, said in (
        (["gateway", "--port", "0"], "spindle: error: give exactly one of --pods"),
        (["gateway", "--pods", "a:1", "--port", "0"], "--allow-unauthenticated for local use"),
        (["adapter-service", "--pods", "a:1", "--pods-dns", "b:2"], "give at most one of --pods and"),
        (["gateway", "--pods", "a:1", *local, *token], "cannot read control token file"),
    ):
        assert main(argv) == 2, argv
        assert said in capfd.readouterr().err, argv


def test_adapter_service_settings_that_cannot_work_are_refused_naming_the_flag(tmp_path):
    """`--base-model` missing, without config.json or with a malformed one, `--redis-url` without a
    scheme and `--storage-dir` naming a file were tracebacks from `spindle adapter-service`."""
    import asyncio

    import pytest

    from adapter_service import server as service_server
    from spindle.errors import ConfigError

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"a":')
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    base = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--pods", "a:1"]
    for flags, said in (
        (["--base-model", str(tmp_path / "none")], "--base-model: .*neither an alias"),
        (["--base-model", str(tmp_path / "empty")], "--base-model: .*has no config.json"),
        (["--base-model", str(tmp_path / "bad")], r"--base-model: .*config\.json: Expecting value"),
        (["--redis-url", "notaurl"], "--redis-url: "),
        (["--storage-dir", str(tmp_path / "file")], "--storage-dir: "),
    ):
        args = command_parser("adapter-service")[1].parse_args([*base, *flags])
        with pytest.raises(ConfigError, match=said):
            asyncio.run(service_server.start(args))


def test_an_unknown_log_level_is_a_usage_error_for_every_service(capsys, monkeypatch):
    """`--log-level bogus` (or SPINDLE_LOG_LEVEL=bogus) was a ValueError traceback from
    `logging.basicConfig`, exit 1, once the command had begun; `spindle up` passed it on and all
    three of its services died of it. Refused naming the flag now; any case is taken, as before."""
    for command in ("serve", "gateway", "adapter-service", "up"):
        parser = command_parser(command)[1]
        assert parser.parse_args(["--log-level", "debug"]).log_level == "DEBUG"
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["--log-level", "bogus"])
        assert exit_.value.code == 2
        assert "argument --log-level: expected DEBUG, INFO" in capsys.readouterr().err, command
    monkeypatch.setenv("SPINDLE_LOG_LEVEL", "verbose")
    with pytest.raises(SystemExit):
        command_parser("gateway")
    assert "SPINDLE_LOG_LEVEL='verbose': expected DEBUG" in capsys.readouterr().err


def test_adapter_service_sizes_timeouts_and_policy_knobs_out_of_range_are_usage_errors(capsys):
    """The adapter service took any number for these: `--popularity-half-life 0` and `--hot-share
    0` divided by zero in every policy round (logged, forever), `--hot-share 1.5` made no adapter
    hot, `--rpc-timeout 0` failed every RPC and its health, zero attempts or timeouts of S3 and
    Redis failed every call, and a zero `--max-adapter-bytes` / `--max-lora-rank` refused every
    upload. Each is now argparse's usage error naming the flag; the values that mean something (0
    bytes staged, idle 0 s) are taken."""
    parser = command_parser("adapter-service")[1]
    for flag, value in (
        ("--popularity-half-life", "0"), ("--hot-share", "0"), ("--hot-share", "1.5"),
        ("--spread-threshold", "-1"),
        ("--lease-ttl", "0"), ("--rpc-timeout", "0"), ("--s3-connect-timeout", "-1"),
        ("--s3-read-timeout", "0"), ("--redis-timeout", "0"), ("--s3-max-attempts", "0"),
        ("--redis-max-attempts", "0"), ("--max-adapter-bytes", "0"), ("--max-lora-rank", "0"),
        ("--staging-max-bytes", "-1"), ("--slot-idle-seconds", "-1"), ("--disk-idle-seconds", "nan"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([flag, value])
        assert exit_.value.code == 2
        assert f"argument {flag}: must be" in capsys.readouterr().err, flag
    args = parser.parse_args(["--staging-max-bytes", "0", "--slot-idle-seconds", "0", "--hot-share", "1"])
    assert (args.staging_max_bytes, args.slot_idle_seconds, args.hot_share) == (0, 0.0, 1.0)


def test_swap_space_that_is_no_size_is_a_usage_error_in_gib(capsys):
    """`--swap-space nan` and `inf` were tracebacks (ValueError, OverflowError) when the GiB became
    bytes, and `-1` was refused as "-1073741824" under the field's name: each is now argparse's
    error naming the flag in the unit it is given in, from `generate` and `serve` alike."""
    for command in ("generate", "serve"):
        parser = command_parser(command)[1]
        for value in ("nan", "inf", "-1"):
            with pytest.raises(SystemExit) as exit_:
                parser.parse_args(["--swap-space", value])
            assert exit_.value.code == 2
            assert f"argument --swap-space: must be 0 GiB or more (and finite), got {value}" in (
                capsys.readouterr().err
            )
        assert parser.parse_args(["--swap-space", "0.5"]).swap_space_bytes == 0.5


def test_an_address_a_service_dials_without_a_port_is_refused_naming_the_flag(tmp_path):
    """The gateway's `--adapter-service notaport` was taken, then dialled and warned of every
    second for as long as it ran ("catalog not refreshed: UNAVAILABLE"); the adapter service's
    `--advertise-address notaport` was handed to every pod as the peer to fetch weights from.
    Each is a ConfigError naming its flag before anything listens; gRPC's own target schemes
    (`ipv4:A:P,B:P` for replicas) are still taken."""
    import asyncio

    from adapter_service import server as service_server
    from gateway import pods
    from gateway import server as gateway_server
    from spindle.errors import ConfigError

    base = [
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--http-port",
        "0",
        "--allow-unauthenticated",
        "--pods",
        "a:1",
    ]
    args = command_parser("gateway")[1].parse_args([*base, "--adapter-service", "notaport"])
    with pytest.raises(ConfigError, match="--adapter-service wants HOST:PORT, got 'notaport'"):
        asyncio.run(gateway_server.start(args))
    flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--pods", "a:1"]
    flags += ["--storage-dir", str(tmp_path), "--advertise-address", "10.0.0.1"]
    args = command_parser("adapter-service")[1].parse_args(flags)
    with pytest.raises(ConfigError, match=r"--advertise-address wants HOST:PORT, got '10\.0\.0\.1'"):
        asyncio.run(service_server.start(args))
    pods.check_target("ipv4:127.0.0.1:1,127.0.0.1:2", "--adapter-service")
    pods.check_target("[::1]:50060", "--adapter-service")


def test_up_on_a_host_that_is_not_this_ones_says_so_not_that_ports_are_in_use():
    """`spindle up --host 8.8.8.8` (or a name that does not resolve) said "port 50051
    (--gateway-port), 8000 (--http-port) ... is in use (another `spindle up`?)": every failed
    bind was taken for a port in use. Now only one is; the rest name --host and why."""
    from spindle import local

    args = command_parser("up")[1].parse_args(["--host", "no-such-host.invalid"])
    with pytest.raises(SpindleError, match=r"--host no-such-host\.invalid: cannot listen there"):
        local._ports_in_use(args)
