"""Structured output (JSON Schema, regex, choice, grammar) on the embedded SmolLM2: outputs checked
by `jsonschema` and `re`, rows beside a constrained one unchanged, speculation, resume, the
bitmask against a plain-torch reference, and bad requests refused (INVALID_ARGUMENT on the pod)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import grpc
import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_service.engine.grammar import Constraint, GrammarCompiler, GrammarError
from model_service.engine.requests import Resume
from model_service.engine.sampler import AllowedTokens, SampleRow, sample
from model_service.engine.sampling_params import SamplingParams
from model_service.engine.sequence import Sequence, Status
from model_service.engine.speculation import Proposal, Speculation, SpeculativeConfig
from model_service.engine.structured_output import StructuredOutput
from model_service.errors import InvalidRequestError
from model_service.pod.generation import GenerationService
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc
from tests.conftest import ROOT, assert_all_blocks_free, make_engine
from tests.service_helpers import pod_in_process

PIRATE = str(ROOT / "adapters" / "smollm2-pirate")

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "string", "maxLength": 12},
        "minItems": 2,
        "maxItems": 3,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "population": {"type": "integer", "minimum": 0, "maximum": 10**9},
                },
                "required": ["name", "population"],
                "additionalProperties": False,
            }
        },
        "required": ["city"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
        },
        "required": ["lat", "lon"],
        "additionalProperties": False,
    },
}
PROMPTS = {
    "person": "Describe a person as JSON with a name and an age.",
    "enum": "What color is the sky? Answer in JSON.",
    "array": "List some fruits as a JSON array.",
    "nested": "Describe Paris as JSON: its name and population.",
    "numbers": "Give the latitude and longitude of Paris, rounded to one decimal, as JSON.",
}
CAT = "Describe a cat as a JSON object with its name and age."
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]
SIDES = ["left", "right"]  # a grammar no other test compiles

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(smollm2):
    """One engine for the module, with the pirate adapter, and async scheduling on (a constrained
    row makes its steps read the tokens before the next; the other rows' tokens stay the same)."""
    return make_engine(smollm2, max_loras=1, lora_modules={"pirate": PIRATE}, async_scheduling="on")


def _chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


FREE = [
    _chat("What is the capital of France?", max_tokens=10),
    _chat("Where is the treasure?", max_tokens=10, adapter="pirate"),
]


@pytest.fixture(scope="module")
def batch(engine) -> dict[str, Any]:
    """The free rows alone, then with every kind of constrained row in one batch."""
    alone = engine.generate(FREE)
    by_regex, person = {"regex": DATE}, {"json_schema": SCHEMAS["person"]}
    constrained = [
        *(_chat(PROMPTS[k], max_tokens=32, structured_output={"json_schema": s}) for k, s in SCHEMAS.items()),
        _chat(CAT, max_tokens=32, structured_output={"json_object": True}),
        _chat("When did the French Revolution start? A date.", max_tokens=12, structured_output=by_regex),
        _chat("Is the sky blue?", max_tokens=5, structured_output={"choice": CHOICES}),
        _chat(PROMPTS["person"], max_tokens=3, structured_output=person),  # cut short
    ]
    masked = []  # steps whose constrained rows sampled on the device after the drain
    launch_masked = engine.overlap.launch_masked
    engine.overlap.launch_masked = lambda *args: (masked.append(len(args[0])), launch_masked(*args))
    try:
        outs = engine.generate(constrained + FREE)
    finally:
        del engine.overlap.launch_masked
    assert_all_blocks_free(engine)
    return {"alone": alone, "outs": outs, "masked": masked}


def test_json_outputs_validate_under_their_schemas(batch):
    for (name, schema), out in zip(SCHEMAS.items(), batch["outs"], strict=False):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    json_object = batch["outs"][len(SCHEMAS)]
    assert json_object.finish_reason == "stop" and isinstance(json.loads(json_object.text), dict)


def test_constrained_steps_overlap_with_their_masks_after_the_drain(batch):
    """With async scheduling, steps with constrained rows sample on the device under masks
    filled while their forward runs (`Overlap.launch_masked`); the speculation tests below check
    their tokens against steps that read every token at once."""
    assert len(batch["masked"]) > 10 and max(batch["masked"]) > 1


def test_regex_and_choice_outputs_match(batch):
    date, choice = batch["outs"][len(SCHEMAS) + 1 : len(SCHEMAS) + 3]
    assert date.finish_reason == "stop" and re.fullmatch(DATE, date.text), date.text
    assert choice.finish_reason == "stop" and choice.text in CHOICES, choice.text


def test_length_marks_a_cut_short_output(batch):
    cut = batch["outs"][len(SCHEMAS) + 3]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)


def test_rows_beside_constrained_ones_are_unchanged(batch):
    """A plain row and a LoRA row give the same tokens batched with constrained rows as alone."""
    for alone, beside in zip(batch["alone"], batch["outs"][-len(FREE) :], strict=True):
        assert beside.token_ids == alone.token_ids
    assert "Paris" in batch["alone"][0].text


def test_a_cached_grammar_starts_at_once_and_resume_continues_it(engine, batch):
    person = batch["outs"][0]
    request = _chat(PROMPTS["person"], max_tokens=32, structured_output={"json_schema": SCHEMAS["person"]})
    rid = engine.add_request(
        messages=request["messages"],
        params=SamplingParams.from_dict(request),
        resume=Resume(person.token_ids[:5], 0),
    )
    seq = engine.requests[rid]
    assert seq.sampling.constraint.compiled.done()  # the schema's compile is cached: no wait
    final = engine.run_to_completion()[rid]
    assert final.token_ids == person.token_ids and final.text == person.text


def test_a_request_waits_for_its_grammar_and_the_others_do_not(engine):
    gate = threading.Event()
    engine.grammars._worker.submit(gate.wait)  # the compile worker is busy until the gate opens
    try:
        sides = StructuredOutput("choice", SIDES)
        waits = engine.add_request(
            messages=[{"role": "user", "content": "Left or right?"}],
            params=SamplingParams(temperature=0, max_tokens=3, structured_output=sides),
        )
        runs = engine.add_request(prompt="Hello", params=SamplingParams(temperature=0, max_tokens=3))
        engine.step()
        assert engine.requests[runs].status is Status.RUNNING
        assert engine.requests[waits].status is Status.WAITING
    finally:
        gate.set()
    final = engine.run_to_completion()
    assert final[waits].text in SIDES and final[waits].finish_reason == "stop"
    assert len(final[runs].token_ids) == 3


def test_compiles_no_request_waits_for_are_dropped(engine):
    """Requests cancelled while their grammars wait to compile: each compile still ran (a queue
    of them delays every later request's grammar), and the compiler kept each one's matcher for
    good, outside its bounded cache. Now one not started is cancelled, one done is cached."""
    gate = threading.Event()
    engine.grammars._worker.submit(gate.wait)  # the compile worker is busy until the gate opens
    try:
        params = [
            SamplingParams(structured_output=StructuredOutput("regex", rx)) for rx in ("[0-9]{7}", "x{7}")
        ]
        gone = [engine.add_request(prompt="Hello", params=p) for p in params]
        compiles = [engine.requests[rid].sampling.constraint.compiled for rid in gone]
        for rid in gone:
            engine.abort(rid)
        engine.run_to_completion()
    finally:
        gate.set()
    assert all(c.cancelled() for c in compiles) and not engine.grammars._compiling
    assert_all_blocks_free(engine)


LOOP = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}}  # a value no output can be


@pytest.mark.parametrize(
    "schema",
    [
        {**LOOP, "$ref": "#/$defs/A"},  # fails at the first mask
        {**LOOP, "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]},
    ],
)
def test_a_grammar_that_cannot_go_on_fails_its_request_not_stops_it(engine, schema):
    """llguidance reads its schema, but its matcher fails where no value can follow: it then
    allows only EOS and reads as stopped. The request fails naming why, without the matcher's
    state dump and grammar; it never stops with output outside its schema."""
    request = _chat(CAT, max_tokens=8, structured_output={"json_schema": schema})
    out = engine.generate([request])[0]
    assert out.finish_reason == "error" and out.text in ("", '{"a": '), out.text
    assert out.error == "structured output: the grammar cannot go on here (NoExtensionBias)"
    assert_all_blocks_free(engine)


def test_speculation_checks_drafts_against_the_grammar(smollm2, batch):
    """n-gram drafts are cut to what the grammar allows and verified under its masks: the greedy
    tokens are those of the run without speculation, and some drafts were accepted."""
    spec = make_engine(smollm2, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    request = _chat(PROMPTS["array"], max_tokens=32, structured_output={"json_schema": SCHEMAS["array"]})
    assert spec.generate([request])[0].token_ids == batch["outs"][2].token_ids
    stats = spec.stats()
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0


def test_a_grammar_failing_under_its_drafts_ends_its_request_not_the_step(smollm2, batch, monkeypatch):
    """A constrained request whose grammar fails while its drafts are verified (fault injected
    into its masks) ends "error"; the request beside it in the same steps finishes as it would."""
    spec = make_engine(smollm2, speculative_config={"method": "ngram", "num_speculative_tokens": 3})

    def fails(self, proposals: list[int], vocab_size: int) -> torch.Tensor:
        raise GrammarError("structured output: the grammar cannot go on here (injected)")

    monkeypatch.setattr(Constraint, "verify_bitmask", fails)
    constrained = _chat(PROMPTS["array"], max_tokens=32, structured_output={"json_schema": SCHEMAS["array"]})
    plain = _chat(PROMPTS["array"], max_tokens=32)
    bad, good = spec.generate([constrained, plain])
    assert bad.finish_reason == "error" and "injected" in bad.error
    assert good.token_ids == make_engine(smollm2).generate([plain])[0].token_ids
    assert spec.stats().spec_proposed_tokens > 0  # drafts were verified: the fault was reached
    assert_all_blocks_free(spec)


def test_a_draft_model_speculates_under_the_grammar(smollm2, batch):
    """A draft model proposes without the grammar (here SmolLM2 itself, so its proposals are
    the target's unconstrained greedy tokens); they are cut to what the grammar allows and
    verified under its masks: the same tokens as without speculation, some drafts accepted."""
    draft = json.dumps({"method": "draft", "model": "smollm2", "num_speculative_tokens": 3})
    spec = make_engine(smollm2, speculative_config=draft)
    request = _chat(PROMPTS["array"], max_tokens=32, structured_output={"json_schema": SCHEMAS["array"]})
    assert spec.generate([request])[0].token_ids == batch["outs"][2].token_ids
    stats = spec.stats()
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0
    assert_all_blocks_free(spec)


def test_drafts_are_cut_and_verify_masks_roll_back(engine, smollm2):
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size, smollm2.config.eos_token_ids)
    constraint = compiler.constraint(StructuredOutput("choice", ["yes", "no"]))
    constraint.compiled.result()
    assert compiler.poll(constraint, [])
    yes = smollm2.tokenizer.encode("yes")[-1]
    no = smollm2.tokenizer.encode("no")[-1]
    assert constraint.valid_prefix([yes, no]) == 1  # "yesno" is not a choice
    before = compiler.allowed_tokens([constraint]).bits.clone()
    bits = constraint.verify_bitmask([yes], smollm2.config.vocab_size)
    assert torch.equal(bits[0], before[0])  # row 0: the mask before the draft
    assert _allowed(bits[1]) == set(smollm2.config.eos_token_ids)  # after "yes": only EOS
    assert torch.equal(compiler.allowed_tokens([constraint]).bits, before)  # rolled back


class _DrawsFromQ:
    """A draft model's stand-in whose q is known: proposes, each step, one draw from each row of
    `q` (over the tokens `support`), and hands q to the rejection sampler."""

    def __init__(self, q: torch.Tensor, support: list[int]) -> None:
        self.q, self.support, self.generator = q, support, torch.Generator().manual_seed(0)

    def propose(self, seqs: list, room: list[int]) -> list[Proposal]:
        picks = torch.multinomial(self.q[:, self.support], 1, generator=self.generator)[:, 0].tolist()
        return [Proposal([self.support[i] for i in picks], self.q) for _ in seqs]

    def on_verified(self, seq, num_accepted: int) -> None:
        pass

    def on_finished(self, seq) -> None:
        pass


def test_a_sampled_drafts_q_is_weighed_under_the_grammar(smollm2):
    """Rejection sampling under a grammar keeps the target's distribution: the draft's second
    token is "yes" or "maybe" (refused: the proposal is cut there) at 0.5 each, the target's
    "yes" or "no" at 0.5 each. A kept "yes" was drawn from q given it is allowed (q' = one-hot),
    and weighed by q (0.5) it was always accepted, by q' half the time: weighed by q, the second
    token came out "yes" three times in four."""
    vocab, tok = smollm2.config.vocab_size, smollm2.tokenizer
    yes, no, maybe = (tok.encode(word)[-1] for word in ("yes", "no", "maybe"))
    compiler = GrammarCompiler(tok, vocab, smollm2.config.eos_token_ids)
    q = torch.zeros(2, vocab)
    q[0, yes], q[1, yes], q[1, maybe] = 1.0, 0.5, 0.5
    spec = Speculation(SpeculativeConfig(method="draft", model="d"), _DrawsFromQ(q, [yes, maybe]), 64, vocab)
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=1.0, seed=0), None, 0)
    seq.sampling.constraint = compiler.constraint(StructuredOutput("regex", "(yes|no)(yes|no)"))
    seq.sampling.constraint.compiled.result()
    assert compiler.poll(seq.sampling.constraint, [])
    logits = torch.full((3, vocab), -30.0)
    logits[0, yes] = logits[1:, yes] = logits[1:, no] = 0.0  # p: "yes", then "yes" or "no"
    trials, second = 200, []
    for _ in range(trials):
        spec.propose([seq])
        emitted, _ = spec.verify(seq, logits[: len(spec.proposals[seq].tokens) + 1])
        second.append(emitted[1])
    assert set(second) <= {yes, no}
    assert abs(second.count(yes) / trials - 0.5) < 4 * (0.25 / trials) ** 0.5


@pytest.mark.parametrize("attribute", ["max_tokens=3", 'stop="zz"'])
def test_drafts_are_checked_under_rules_llguidance_cannot_roll_back(engine, attribute):
    """A Lark rule with `max_tokens=` or `stop=`: llguidance cannot roll its matcher back over
    it, and the failed rollback after the verify masks left the matcher in error, so under
    speculation such a request ended "error" (INTERNAL) at its first draft; nor does its
    `validate_tokens` count `max_tokens=` past the first token, so drafts past it were kept."""
    grammar = StructuredOutput("grammar", f'start: word "!"\nword[{attribute}]: /[a-z ]+/')
    constraint = engine.grammars.constraint(grammar)
    constraint.compiled.result()
    assert engine.grammars.poll(constraint, [])
    words = engine.tokenizer.hf.encode(" the cat sat on", add_special_tokens=False)
    assert constraint.valid_prefix(words) == (3 if attribute == "max_tokens=3" else 4)
    bits = constraint.verify_bitmask(words[:2], engine.vocab_size)
    for token, mask in zip(words[:2], bits, strict=False):
        assert token in _allowed(mask)
        constraint.accept(token)  # the matcher is where it was before the drafts
    assert torch.equal(bits[2], engine.grammars.allowed_tokens([constraint]).bits[0])


def test_a_complete_output_may_end_with_any_of_the_engines_eos_tokens(smollm2):
    """The mask allows every token the engine stops on, not only the tokenizer's `eos_token`
    (Gemma's chat turns end with `<end_of_turn>`, its tokenizer's EOS is `<eos>`): here SmolLM2
    with `<|endoftext|>` (0) as a second EOS beside its `<|im_end|>` (2)."""
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size, {0, 2})
    constraint = compiler.constraint(StructuredOutput("choice", ["yes"]))
    constraint.compiled.result()
    assert compiler.poll(constraint, smollm2.tokenizer.encode("yes")[-1:])
    assert _allowed(compiler.allowed_tokens([constraint]).bits[0]) == {0, 2}


def test_a_choice_of_thousands_of_options_is_served(engine):
    """A choice was a grammar rule with an alternative per option: from 2,000 options on,
    llguidance's parser failed at the first mask ("Current row has 2001 items; max is 2000"), and
    every such request ended "error". The options are one lexeme now, any number of them."""
    options = [f"{i:04d}-{'cat' if i % 2 else 'dog'}é\n" for i in range(3000)]
    constraint = engine.grammars.constraint(StructuredOutput.from_dict({"choice": options}))
    constraint.compiled.result()
    assert engine.grammars.poll(constraint, [])
    for token in engine.tokenizer.hf.encode(options[1234], add_special_tokens=False):
        assert token in _allowed(engine.grammars.allowed_tokens([constraint]).bits[0])
        constraint.accept(token)
    assert constraint.done


def _allowed(bits: torch.Tensor) -> set[int]:
    return {32 * w + b for w, word in enumerate(bits.tolist()) for b in range(32) if (word >> b) & 1}


# --- the bitmask in the sampler, against plain torch ---------------------------------------


def test_allowed_tokens_match_a_torch_reference():
    torch.manual_seed(0)
    vocab, words = 70, 3  # a vocabulary that does not fill its last word
    logits = torch.randn(5, vocab)
    bits = torch.randint(-(2**31), 2**31, (2, words), dtype=torch.int32)
    bits[1] = 0
    bits[1, 2] = 1 << 3  # row 3 may take token 67 only
    masked = AllowedTokens([1, 3], bits).apply(logits)
    expected = logits.clone()
    for row, word_bits in zip([1, 3], bits.tolist(), strict=True):
        for t in range(vocab):
            if not (word_bits[t // 32] >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    assert torch.equal(masked, expected)
    greedy = [SampleRow(SamplingParams(temperature=0), None, [], 0)] * 5
    sampled = [SampleRow(SamplingParams(temperature=2.0), None, [], 0)] * 5
    assert sample(logits, greedy, AllowedTokens([1, 3], bits))[0] == expected.argmax(-1).tolist()
    for _ in range(20):
        tokens, _ = sample(logits, sampled, AllowedTokens([1, 3], bits))
        assert tokens[3] == 67 and expected[1, tokens[1]] > float("-inf")


# --- bad requests --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        ({"json_schema": {"type": "array", "uniqueItems": True}}, 'Unimplemented keys: ["uniqueItems"]'),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "start: missing"}, 'unknown name: "missing"'),
        ({"grammar": "start: w\nw[max_tokens=5, temperature=0.2]: /x+/"}, "temperature= is not supported"),
        ({"choice": []}, "non-empty list"),
        ({"json_object": False}, "must be true"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"xml": "x"}, "exactly one of"),
    ],
)
def test_bad_structured_outputs_are_refused_with_the_library_message(structured, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as refused:
        SamplingParams.from_dict({"structured_output": structured})
    assert str(refused.value).count("structured_output") == 1  # the field named once, not twice


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.sampled_from(["json_schema", "regex", "grammar", "choice"]),
    st.one_of(
        st.text(max_size=30),
        st.text(alphabet='()[]{}|*+?\\^$.:=";#-az ', max_size=30),
        st.sampled_from(["[" * 5000, '{"items": ' * 3000, "(" * 3000, "root ::= " + "(" * 2000, "#"]),
    ),
)
def test_any_text_is_accepted_or_refused_never_an_unexpected_error(kind, text):
    """What a hostile caller may send: only InvalidRequestError (INVALID_ARGUMENT) or a grammar."""
    with contextlib.suppress(InvalidRequestError):
        StructuredOutput.from_dict({kind: [text] if kind == "choice" else text})


def test_gbnf_grammars_are_converted():
    so = StructuredOutput.from_dict({"grammar": 'root ::= "yes" | "no"'})
    assert "yes" in so.grammar


def test_beams_are_refused():
    with pytest.raises(InvalidRequestError, match="num_beams"):
        SamplingParams.from_dict({"num_beams": 2, "structured_output": {"choice": ["a"]}})


def test_a_large_schema_is_read_off_the_pods_event_loop():
    """llguidance takes up to seconds to check a large schema (many optional properties); read on
    the pod's event loop, every stream, health check and load report of the pod waited for it."""
    properties = {f"p{i}": {"type": "integer"} for i in range(3000)}
    schema = json.dumps({"type": "object", "properties": properties}, separators=(",", ":"))
    so = pb.StructuredOutput(json_schema=schema)
    request = pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(structured_output=so))
    pod = SimpleNamespace(lost=None, draining=False, ready=True, inflight={})
    context = SimpleNamespace(time_remaining=lambda: None)

    async def run() -> list[float]:
        ticks: list[float] = []

        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.002)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        start = time.monotonic()
        _, kwargs, _ = await GenerationService(pod, tracer=None)._admissible(request, context)
        end = time.monotonic()
        ticker.cancel()
        assert kwargs["params"].structured_output.kind == "json_schema"
        return [t for t in ticks if start < t < end]

    assert len(asyncio.run(run())) >= 3  # the loop ran while the schema was read (none: it waited)


def test_the_pod_refuses_bad_structured_output_and_serves_good(smollm2):
    async def run() -> None:
        async with (
            pod_in_process(smollm2, "smollm2") as pod,
            grpc.aio.insecure_channel(f"127.0.0.1:{pod.port}") as channel,
        ):
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def generate(**structured: Any) -> list[pb.GenerateResponse]:
                request = pb.GenerateRequest(
                    chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Is water wet?")]),
                    max_tokens=4,
                    sampling=pb.SamplingParams(
                        temperature=0, structured_output=pb.StructuredOutput(**structured)
                    ),
                )
                return [m async for m in stub.Generate(request)]

            refusals = {
                'Unimplemented keys: ["not"]': {"json_schema": json.dumps({"not": {"type": "string"}})},
                "unclosed character class": {"regex": "(["},
                "names no kind": {},
                'unknown special token: "<|foo|>"': {"grammar": "start: <|foo|>"},  # found by the compile
            }
            for message, structured in refusals.items():
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await generate(**structured)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert message in e.value.details()
            msgs = await generate(choice=pb.Choices(choices=CHOICES))
            text = "".join(m.chunk.text for m in msgs if m.HasField("chunk"))
            assert text in CHOICES and msgs[-1].final.finish_reason == pb.FINISH_REASON_STOP

    asyncio.run(run())


# A child process: a grammar that overflows a thread's stack kills its process (SIGSEGV), which
# must be the child's, not the test run's. It reads a chain of 8,000 Lark rules (each names the
# next: 80 KB), compiles it on the grammar worker (over a byte vocabulary), then reads a chain too
# long to serve.
DEEP_GRAMMARS = """
import llguidance
from model_service.engine import grammar
from model_service.engine.structured_output import StructuredOutput
from model_service.errors import InvalidRequestError

def chain(n):
    return "start: r0\\n" + "".join(f"r{i}: r{i + 1}\\n" for i in range(n)) + f'r{n}: "y"\\n'

class Bytes:
    eos_token_id, bos_token_id, tokens = 256, None, [bytes([i]) for i in range(256)] + [b"<eos>"]
    def __call__(self, text):
        return list(text)

deep = StructuredOutput.from_dict({"grammar": chain(8000)})
print("read", flush=True)
vocab = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))
grammar._llg_tokenizer = lambda *_: vocab
compiler = grammar.GrammarCompiler(None, 257, [256])
constraint = compiler.constraint(deep)
constraint.compiled.result()  # raises if it did not compile
compiler.poll(constraint, [])
print("compiled", constraint.valid_prefix(list(b"y")), flush=True)
try:
    StructuredOutput.from_dict({"grammar": chain(40000)})
except InvalidRequestError as e:
    print("refused", e)
"""


def test_deep_grammars_are_read_and_compiled_and_too_long_ones_refused():
    """llguidance compiles rule references by recursion, 3-10 KB of native stack a level: an
    8,000-rule chain overflowed the 8 MB stack of the thread that read it (the pod's event loop)
    and of the compile worker. Read and compiled now on threads with a stack for any grammar up to
    MAX_GRAMMAR_CHARS; a longer one is refused before llguidance sees it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, "-c", DEEP_GRAMMARS], env=env, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr[-3000:])
    lines = child.stdout.splitlines()
    assert lines[:2] == ["read", "compiled 1"]
    assert lines[2] == (
        "refused structured_output.grammar is 577,806 characters long; at most 262,144 are served"
    )
