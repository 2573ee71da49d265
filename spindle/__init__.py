"""Spindle's wire contracts and what every process shares (no torch here: the gateway and the
client import this package and must start fast).

- `spindle.v1`: code generated from `protos/spindle/v1/*.proto` by `scripts/gen_protos.sh`
  (committed; `tests/test_protos.py` fails when it and the protos disagree);
- `spindle.client`: a Generation client and the `spindle chat` / `spindle complete` commands;
- `spindle.telemetry`: OpenTelemetry from the standard `OTEL_*` variables;
- `spindle.envflags`: every command-line flag also read from a `SPINDLE_*` variable;
- `spindle.serving`: health, reflection and signal handling shared by the gRPC servers.
"""
