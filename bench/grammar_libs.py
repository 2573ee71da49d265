"""xgrammar against llguidance on the embedded SmolLM2's tokenizer: compile time, per-token mask
time and JSON-Schema coverage (the comparison behind the grammar engine's choice,
docs/architecture.md "Structured output"). Needs both libraries, which the project does not:

    .venv/bin/pip install xgrammar llguidance
    PYTHONPATH=. .venv/bin/python bench/grammar_libs.py     # one JSON line per library

Mask time is measured walking a valid instance of each schema token by token: compute the
allowed-token bitmask, then accept the instance's next token (what one decode step costs a
constrained row on the host)."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

VOCAB = 49152  # SmolLM2's

TWENTY = {
    "type": "object",
    "properties": {
        **{f"s{i}": {"type": "string", "maxLength": 20} for i in range(7)},
        **{f"n{i}": {"type": "integer", "minimum": 0, "maximum": 1000} for i in range(7)},
        **{f"b{i}": {"type": "boolean"} for i in range(3)},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "kind": {"enum": ["a", "b", "c"]},
        "score": {"type": "number"},
    },
    "required": [f"s{i}" for i in range(7)] + [f"n{i}" for i in range(7)] + ["kind"],
    "additionalProperties": False,
}
INSTANCE = {  # in the schema's property order (xgrammar generates properties in that order)
    **{f"s{i}": f"value {i}" for i in range(7)},
    **{f"n{i}": 17 * i for i in range(7)},
    "tags": ["x", "y"],
    "kind": "b",
}

# JSON Schema features, each in a schema of its own: does the library compile it, and does it
# enforce it (a violating instance refused)? (schema, a valid instance, a violating instance)
FEATURES: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "required+properties": (
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"a": "x"},
        {},
    ),
    "enum": ({"enum": ["red", "green"]}, "red", "blue"),
    "const": ({"const": 42}, 42, 43),
    "minItems/maxItems": (
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        [1, 2],
        [1],
    ),
    "minimum/maximum": ({"type": "integer", "minimum": 3, "maximum": 9}, 5, 12),
    "exclusiveMinimum (number)": ({"type": "number", "exclusiveMinimum": 0}, 0.5, -1.5),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 15, 7),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdef"),
    "pattern": ({"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, "ab-12", "ab-1"),
    "format: date-time": ({"type": "string", "format": "date-time"}, "2024-01-02T03:04:05Z", "yesterday"),
    "format: email": ({"type": "string", "format": "email"}, "a@b.co", "not an email"),
    "format: uuid": ({"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "x-y"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, 3, None),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    "allOf": (
        {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
        {"a": 1},
        {},
    ),
    "$ref/$defs": (
        {
            "$defs": {"p": {"type": "integer"}},
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/p"}},
            "required": ["x"],
        },
        {"x": 1},
        {"x": "s"},
    ),
    "recursive $ref": (
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                    "required": ["c"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/n",
        },
        {"c": [{"c": []}]},
        {"c": [{}]},
    ),
    "additionalProperties: schema": (
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"k": 1},
        {"k": "v"},
    ),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
        {"x1": 1},
        {"y": 1},
    ),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
        [1, "a"],
        ["a", 1],
    ),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "not": ({"not": {"type": "string"}}, 1, "s"),
    "if/then/else": ({"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}}, 3, -3),
    "dependentRequired": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        {"a": 1, "b": 2},
        {"a": 1},
    ),
    "minProperties": ({"type": "object", "minProperties": 1}, {"a": 1}, {}),
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, mask: torch.Tensor, row: int = 0) -> None:
        m.fill_next_token_bitmask(mask, row)

    def fill_batch(self, matchers: list[Any], mask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):  # what vLLM's xgrammar backend does on one thread
            m.fill_next_token_bitmask(mask, i)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        message = self.ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if message:
            raise ValueError(message)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.ll.LLMatcher(self.tokenizer, compiled)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m: Any, mask: torch.Tensor, row: int = 0) -> None:
        self.llt.fill_next_token_bitmask(m, mask, row)

    def fill_batch(self, matchers: list[Any], mask: torch.Tensor) -> None:
        if not hasattr(self, "executor"):
            self.executor = self.ll.LLExecutor()
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))


def _walk(lib: Any, compiled: Any, ids: list[int], eos: int) -> tuple[bool, list[float]]:
    """Mask, check and accept each token of `ids` then EOS; (all allowed, mask times in s)."""
    m = lib.matcher(compiled)
    mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    times = []
    for token in [*ids, eos]:
        t = time.perf_counter()
        lib.fill(m, mask)
        times.append(time.perf_counter() - t)
        if not (int(mask[0, token // 32]) >> (token % 32)) & 1 or not lib.accept(m, token):
            return False, times
    return True, times


def _batch_mask_ms(lib: Any, compiled: Any, ids: list[int], rows: int = 64) -> float:
    """Median time to fill the masks of `rows` matchers at different places of the instance (one
    decode step of a batch of constrained rows; llguidance spreads it over its thread pool)."""
    matchers = []
    for j in range(rows):
        m = lib.matcher(compiled)
        for token in ids[: (7 * j) % len(ids)]:
            lib.accept(m, token)
        matchers.append(m)
    mask, times = torch.full((rows, (VOCAB + 31) // 32), -1, dtype=torch.int32), []
    for _ in range(20):
        t = time.perf_counter()
        lib.fill_batch(matchers, mask)
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def _accepts(lib: Any, compiled: Any, tokenizer: Any, value: Any, eos: int) -> bool:
    ids = tokenizer.encode(json.dumps(value), add_special_tokens=False)
    return _walk(lib, compiled, ids, eos)[0]


def main() -> None:
    from model_service.models.loader import resolve_model_path
    from model_service.models.tokenizer import Tokenizer

    path = resolve_model_path("smollm2")
    tok = Tokenizer.from_dir(path.parent, gguf_file=path.name)
    assert tok is not None
    hf, eos = tok.hf, tok.eos_token_id
    torch.set_num_threads(1)
    for cls in (XGrammar, LLGuidance):
        t = time.perf_counter()
        lib = cls(hf, VOCAB)
        setup = time.perf_counter() - t
        compile_ms, mask = [], torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
        for _ in range(5):  # compile, and the first mask (llguidance compiles lazily, in the matcher)
            t = time.perf_counter()
            compiled = lib.compile(TWENTY)
            lib.fill(lib.matcher(compiled), mask)
            compile_ms.append(1e3 * (time.perf_counter() - t))
        ids = hf.encode(json.dumps(INSTANCE), add_special_tokens=False)
        ok, times = _walk(lib, compiled, ids, eos)
        us = sorted(1e6 * x for x in times)
        features = {}
        for feature, (schema, good, bad) in FEATURES.items():
            try:
                compiled_feature = lib.compile(schema)
            except Exception as e:  # the library's refusal is the result
                features[feature] = "refused: " + str(e).splitlines()[0][:90]
                continue
            accepts = _accepts(lib, compiled_feature, hf, good, eos)
            enforces = not _accepts(lib, compiled_feature, hf, bad, eos)
            features[feature] = (
                "enforced" if accepts and enforces else f"valid ok {accepts}, violation refused {enforces}"
            )
        result = {
            "library": lib.name,
            "setup": "SmolLM2 tokenizer, CPU, one torch thread",
            "tokenizer_setup_ms": round(setup * 1e3),
            "compile_20_properties_ms": {
                "median": round(statistics.median(compile_ms), 1),
                "min": round(min(compile_ms), 1),
            },
            "instance_tokens": len(ids),
            "instance_accepted": ok,
            "mask_us": {
                "p50": round(us[len(us) // 2]),
                "p90": round(us[int(len(us) * 0.9)]),
                "max": round(us[-1]),
            },
            "masks_64_rows_ms": round(_batch_mask_ms(lib, compiled, ids), 2),
            "json_schema_features": features,
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
