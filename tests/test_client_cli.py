"""The client commands (`spindle chat`, `complete`, `models`, `adapters`) as a person or a script
meets them: usage errors are exit 2 naming the flag, failures are one line, never a traceback.
No cluster: the calls that would reach one are replaced, so each test runs in milliseconds."""

from __future__ import annotations

import io
import os

import grpc
import pytest

from spindle import client as client_module
from spindle.cli import main
from spindle.v1 import generation_pb2 as pb


@pytest.mark.parametrize(
    "argv, says",
    [
        (["chat", "--gateway", "127.0.0.1", "hi"], "has no port"),  # gRPC dialled :443
        (["chat", "--gateway", "http://127.0.0.1:8000", "hi"], "not its HTTP address"),
        (["models", "--gateway", "::1"], "has no port"),
        # gRPC reads an unbracketed IPv6 target as an address on port 443: dialled, never reached
        (["models", "--gateway", "::1:50051"], "[::1]:PORT"),
        (["chat", "--gateway", "fd00::5", "hi"], "[::1]:PORT"),
        (["adapters", "list", "--gateway", "gateway.local"], "has no port"),
        (["chat", "--timeout", "0", "hi"], "--timeout: must be more than 0 seconds"),
        (["adapters", "--timeout", "-1", "list"], "--timeout: must be more than 0 seconds"),
        # past the request's int32/int64 fields: was a protobuf ValueError traceback
        (["complete", "--max-tokens", "99999999999", "hi"], "--max-tokens: must be in [-2147483648,"),
        (["chat", "--top-k", "-99999999999", "hi"], "--top-k: must be in"),
        (["chat", "--seed", str(1 << 64), "hi"], "--seed: must be in"),
    ],
)
def test_flag_values_that_cannot_work_are_usage_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_gateway_addresses_grpc_accepts_are_taken_as_given():
    for target in ("127.0.0.1:50051", "[::1]:50051", "dns:///gw.local:443", "unix:/tmp/gw.sock"):
        assert client_module.gateway_target(target) == target


def test_models_waits_as_long_as_timeout_says(monkeypatch, capsys):
    seen = []

    def list_models(self: client_module.Client, timeout: float = 10.0) -> list[pb.ModelInfo]:
        seen.append(timeout)
        return [pb.ModelInfo(id="base-model", kind=pb.MODEL_KIND_BASE)]

    monkeypatch.setattr(client_module.Client, "list_models", list_models)
    assert main(["models", "--timeout", "42"]) == 0
    assert seen == [42.0]
    assert capsys.readouterr().out == "base-model\tbase\n"


@pytest.mark.parametrize("command", ["chat", "complete"])
def test_an_empty_message_on_stdin_is_refused_not_sent(command, monkeypatch, capsys):
    def generate(*args: object, **kwargs: object) -> client_module.Completion:
        raise AssertionError("an empty message was sent")

    monkeypatch.setattr(client_module.Client, "generate", generate)
    monkeypatch.setattr("sys.stdin", io.StringIO(" \n"))
    assert main([command]) == 2
    assert "is empty: give it as arguments or on stdin" in capsys.readouterr().err


class _Expired(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "Deadline Exceeded"


def test_a_deadline_that_ran_out_names_the_timeout_flag(monkeypatch, capsys):
    def generate(*args: object, **kwargs: object) -> client_module.Completion:
        raise _Expired()

    monkeypatch.setattr(client_module.Client, "generate", generate)
    assert main(["chat", "--timeout", "2.5", "hi"]) == 1
    assert "no answer within --timeout 2.5 s" in capsys.readouterr().err


def test_ctrl_c_mid_answer_ends_the_line_and_exits_130(monkeypatch, capsys):
    def generate(self: client_module.Client, request: pb.GenerateRequest, timeout: float, on_text):
        on_text("Once upon")
        raise KeyboardInterrupt

    monkeypatch.setattr(client_module.Client, "generate", generate)
    assert main(["chat", "hi"]) == 130
    assert capsys.readouterr().out == "Once upon\n"


def test_a_reader_that_goes_away_is_a_quiet_exit_not_a_traceback(monkeypatch):
    """`spindle models | head -1`: the pipe closes while the command still writes."""
    many = [pb.ModelInfo(id=f"adapter-{i}", kind=pb.MODEL_KIND_ADAPTER) for i in range(20_000)]
    monkeypatch.setattr(client_module.Client, "list_models", lambda self, timeout=10.0: many)
    read, write = os.pipe()
    os.close(read)
    with open(write, "w") as closed_pipe:
        monkeypatch.setattr("sys.stdout", closed_pipe)
        assert main(["models"]) == 141


def test_registering_a_directory_that_does_not_exist_says_so(tmp_path, capsys):
    assert main(["adapters", "register", "x", str(tmp_path / "typo")]) == 2
    assert "(found: no such file or directory)" in capsys.readouterr().err


def test_spindle_without_a_command_is_a_usage_error_on_stderr(capsys):
    """As argparse does it: the usage goes to stderr, leaving stdout empty for a script's pipe."""
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage: spindle COMMAND" in err
    assert main(["--help"]) == 0
    assert "usage: spindle COMMAND" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["models"], ["adapters", "list"]])
@pytest.mark.parametrize(
    "flags, says",
    [
        (["--tls-ca-file", "/no/such/ca.pem"], "TLS file '/no/such/ca.pem' does not exist"),
        (["--tls-cert-file", __file__], "give both --tls-cert-file and --tls-key-file"),
    ],
)
def test_tls_files_that_cannot_work_are_usage_errors(command, flags, says, capsys):
    """Exit 2, as every other setting to fix (it was exit 1: the exit code of a failed call)."""
    assert main([*command, *flags]) == 2
    assert says in capsys.readouterr().err
