"""Prompt logprobs (`prompt_logprobs`): each prompt token after the first, its logprob given the
tokens before it and the top N, against HF's float32 `log_softmax` of the prompt's logits (and
PEFT's, under an adapter); through chunked prefill, beside other requests, past a prefix cache
that holds the prompt, and for prompt-only requests (`max_tokens` 0)."""

from __future__ import annotations

import pytest
import torch

from model_service.engine.sampling_params import SamplingParams
from model_service.errors import InvalidRequestError
from spindle.v1 import generation_pb2 as pb
from tests.conftest import assert_all_blocks_free, make_engine
from tests.test_lora import make_adapter

LONG = [(7 * i + 3) % 300 + 5 for i in range(37)]  # 37 tokens: several chunks of 8
SHORT = [11, 42, 99, 5, 17]


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama.name, dtype=torch.float32).eval()


def hf_prompt_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row i the float32 log_softmax that predicts prompt token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches(out, ids: list[int], ref: torch.Tensor, k: int) -> None:
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) - 1
    want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert [lp.logprob for lp in got] == pytest.approx(want.tolist(), abs=1e-5)
    vals, top = ref.topk(k, dim=-1)
    for i, lp in enumerate(got):
        assert [t for t, _ in lp.top] == top[i].tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals[i].tolist(), abs=1e-5)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], **kw) -> dict:
    """Every output of each request, by id (the engine run to completion)."""
    for rid, (ids, params) in requests.items():
        engine.add_request(prompt_token_ids=ids, params=params, request_id=rid, **kw)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_prompt_logprobs_equal_hf_chunked_batched_past_the_prefix_cache(tiny_llama, hf_tiny, overlap):
    """A chunk budget of 8 splits the long prompt over five steps, run beside a plain request and
    a prompt-only one; the prompt's blocks are in the prefix cache already (an earlier request),
    which a scored prompt must not reuse. The scores come once, in the request's first output;
    with async scheduling (tokens sampled on the device, read a step later) too."""
    engine = make_engine(tiny_llama, max_num_batched_tokens=8, block_size=4, async_scheduling=overlap)
    run(engine, {"warm": ([*LONG, 1, 2], SamplingParams(max_tokens=1, temperature=0))})
    outs = run(
        engine,
        {
            "scored": (LONG, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3)),
            "plain": (SHORT, SamplingParams(max_tokens=4, temperature=0)),
            "only": (SHORT, SamplingParams(max_tokens=0, prompt_logprobs=0)),
        },
    )
    assert_matches(outs["scored"][0], LONG, hf_prompt_logprobs(hf_tiny, LONG), 3)
    assert all(o.prompt_logprobs is None for o in outs["scored"][1:])
    assert len(outs["scored"][-1].token_ids) == 3
    assert all(o.prompt_logprobs is None for o in outs["plain"])
    (only,) = outs["only"]
    assert only.finished and only.finish_reason == "length" and only.token_ids == []
    assert_matches(only, SHORT, hf_prompt_logprobs(hf_tiny, SHORT), 0)
    assert_all_blocks_free(engine)


def test_a_one_token_prompt_has_no_prompt_logprobs(tiny_llama):
    outs = run(make_engine(tiny_llama), {"r": ([7], SamplingParams(max_tokens=0, prompt_logprobs=2))})
    assert [(o.prompt_logprobs, o.finish_reason) for o in outs["r"]] == [([], "length")]


def test_max_tokens_zero_needs_prompt_logprobs_and_beams_refuse_them():
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0).validate()
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1, num_beams=2, temperature=0).validate()


def test_prompt_logprobs_under_an_adapter_equal_peft(tiny_llama, hf_tiny, tmp_path):
    from peft import PeftModel

    spec = {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    path = make_adapter(hf_tiny, tmp_path / "a", seed=5, scale=0.3, **spec)
    engine = make_engine(tiny_llama, max_loras=1, lora_modules={"a": str(path)}, max_num_batched_tokens=16)
    outs = run(engine, {"r": (LONG, SamplingParams(max_tokens=0, prompt_logprobs=2))}, adapter="a")
    peft_model = PeftModel.from_pretrained(hf_tiny, str(path))
    try:
        ref = hf_prompt_logprobs(peft_model, LONG)
    finally:
        peft_model.unload()
    assert not torch.allclose(ref, hf_prompt_logprobs(hf_tiny, LONG), atol=1e-3)  # the adapter matters
    assert_matches(outs["r"][0], LONG, ref, 2)


def test_smollm2_prompt_logprobs_equal_hf(smollm2, hf_smollm2):
    ids = smollm2.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    outs = run(
        make_engine(smollm2, max_num_batched_tokens=6),
        {"r": (ids, SamplingParams(max_tokens=1, prompt_logprobs=1))},
    )
    assert_matches(outs["r"][0], ids, hf_prompt_logprobs(hf_smollm2, ids), 1)


def test_the_wire_carries_prompt_logprobs_in_the_first_chunk_only(tiny_llama):
    """The gRPC request's `prompt_logprobs` reaches the engine; the scores come back in the
    first chunk, each named by its prompt token, even with no token beside them (max_tokens 0)."""
    from model_service.pod import wire

    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=SHORT), max_tokens=0, prompt_logprobs=1)
    kwargs = wire.engine_request(req)
    assert kwargs["params"].prompt_logprobs == 1 and kwargs["params"].max_tokens == 0
    engine = make_engine(tiny_llama)
    engine.add_request(**kwargs, request_id="r")
    (out,) = engine.run_to_completion().values()
    msg = wire.chunk([out])
    assert msg is not None
    got = msg.chunk.prompt_logprobs
    assert [lp.token_id for lp in got] == SHORT
    assert not got[0].HasField("logprob") and not got[0].top  # nothing predicts the first token
    assert [lp.logprob for lp in got[1:]] == pytest.approx([lp.logprob for lp in out.prompt_logprobs])
    assert [len(lp.top) for lp in got] == [0, 1, 1, 1, 1]
    assert list(msg.chunk.token_ids) == [] and wire.final(out).final.finish_reason == pb.FINISH_REASON_LENGTH


# --- the HTTP front ------------------------------------------------------------------------


def test_http_fields_ask_the_pods_for_the_prompts_logprobs():
    from spindle.openai_api.requests import chat_request, completion_request

    def completion(**body):
        return completion_request({"prompt": "a b", **body}, {"m"})

    req, call = completion(echo=True, logprobs=2, max_tokens=0)  # lm-eval's loglikelihood
    assert (req.prompt_logprobs, req.max_tokens, call.echo, call.prompt_logprobs) == (2, 0, True, False)
    assert completion(echo=True, max_tokens=0)[0].prompt_logprobs == 0  # scored only to run no output
    assert not completion(echo=True)[0].HasField("prompt_logprobs")  # the prompt's text only
    assert not completion(logprobs=2)[0].HasField("prompt_logprobs")
    req, call = completion(prompt_logprobs=0)
    assert req.HasField("prompt_logprobs") and req.prompt_logprobs == 0 and call.prompt_logprobs
    req, call = chat_request({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 3}, {"m"})
    assert req.prompt_logprobs == 3 and call.prompt_logprobs


def test_http_echo_logprobs_and_prompt_logprobs_equal_hf(spindle_up, smollm2, hf_smollm2):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) and vLLM's `prompt_logprobs`
    through the `openai` SDK against `spindle up`: the prompt's logprobs are HF's."""
    import openai

    client = openai.OpenAI(base_url=spindle_up.http, api_key="none", max_retries=0)
    text = "The capital of France is Paris"
    ids = smollm2.tokenizer.encode(text)
    ref = hf_prompt_logprobs(hf_smollm2, ids)
    want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    out = client.completions.create(
        model="smollm2-135m-instruct", prompt=text, echo=True, logprobs=2, max_tokens=0
    )
    (choice,) = out.choices
    lp = choice.logprobs
    assert choice.text == text and choice.finish_reason == "length" and out.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    assert "".join(lp.tokens) == smollm2.tokenizer.decode(ids, skip_special_tokens=False)
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    top = ref.topk(2, dim=-1).values.flatten().tolist()
    assert [v for t in lp.top_logprobs[1:] for v in sorted(t.values(), reverse=True)[:2]] == pytest.approx(
        top, abs=1e-4
    )
    streamed = client.completions.create(
        model="smollm2-135m-instruct",
        prompt=text,
        echo=True,
        logprobs=2,
        max_tokens=1,
        temperature=0,
        stream=True,
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].logprobs.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-4)
    chat = client.completions.create(
        model="smollm2-135m-instruct", prompt=text, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    scores = chat.choices[0].model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(ids)
    got = [s[str(t)]["logprob"] for s, t in zip(scores[1:], ids[1:], strict=True)]
    assert got == pytest.approx(want, abs=1e-4)
    assert all(any(v["rank"] == 1 for v in s.values()) for s in scores[1:])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_scored_prompt_preempted_mid_prefill_keeps_its_scores(tiny_llama, hf_tiny, mode):
    """Preempted after two of its five chunks: recomputed from position 0 (the rows scored
    already not scored twice, none skipped) or swapped back in, its prompt logprobs are HF's."""
    engine = make_engine(tiny_llama, max_num_batched_tokens=8, block_size=4, preemption_mode=mode)
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    engine.add_request(prompt_token_ids=LONG, params=params, request_id="r")
    outs = engine.step() + engine.step()
    seq = engine.requests["r"]
    assert len(seq.output.prompt_logprobs) == 16
    engine.scheduler._preempt(seq)
    while engine.has_unfinished():
        outs += engine.step()
    assert engine.scheduler.num_preemptions == 1
    (first,) = [o for o in outs if o.prompt_logprobs is not None]
    assert_matches(first, LONG, hf_prompt_logprobs(hf_tiny, LONG), 1)


def test_http_chat_prompt_logprobs_on_the_response(spindle_up, smollm2):
    import openai

    client = openai.OpenAI(base_url=spindle_up.http, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    scores = out.model_extra["prompt_logprobs"]
    ids = smollm2.tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert len(scores) == len(ids) and scores[0] is None
    assert [next(iter(s)) for s in scores[1:]] == [str(t) for t in ids[1:]]  # k = 0: the token's own only
    assert all(s[str(t)]["logprob"] <= 0 for s, t in zip(scores[1:], ids[1:], strict=True))


def test_spindle_generate_prints_a_requests_prompt_logprobs(tiny_llama, hf_tiny, tmp_path, capsys):
    import json

    from spindle.cli import main

    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(json.dumps({"prompt_token_ids": SHORT, "prompt_logprobs": 1, "max_tokens": 0}) + "\n")
    argv = ["generate", "--model", tiny_llama.name, "--requests", str(reqs), "--json", "--device", "cpu"]
    assert main(argv) == 0
    (out,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out["finish_reason"] == "length" and out["token_ids"] == []
    ref = hf_prompt_logprobs(hf_tiny, SHORT)
    assert out["prompt_logprobs"][0] is None
    got = [e["logprob"] for e in out["prompt_logprobs"][1:]]
    assert got == pytest.approx(ref.gather(1, torch.tensor(SHORT[1:])[:, None])[:, 0].tolist(), abs=1e-5)
    assert [e["top_logprobs"][0][0] for e in out["prompt_logprobs"][1:]] == ref.argmax(-1).tolist()


def test_a_step_scores_at_most_its_cap_of_prompt_rows(tiny_llama, hf_tiny):
    """Scored rows are a vocabulary of float32 each (twice): two prompts of 400 tokens under a
    budget of 2,048 tokens a step would score ~800 rows at once; the step takes 512
    (`MAX_SCORED_ROWS`) and the rest go in the next, with the same scores as HF's."""
    from model_service.engine import scheduler as scheduler_module
    from model_service.engine.prompt_logprobs import MAX_SCORED_ROWS

    engine = make_engine(tiny_llama, max_num_batched_tokens=2048, block_size=16)
    prompts = {f"p{j}": [(7 * i + 3 * j) % 300 + 5 for i in range(400)] for j in range(2)}
    scored_per_step: list[int] = []
    schedule = engine.scheduler.schedule

    def counting():
        batch = schedule()
        scored_per_step.append(MAX_SCORED_ROWS - batch.scored_rows)
        return batch

    engine.scheduler.schedule = counting
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    outs = run(engine, {rid: (ids, params) for rid, ids in prompts.items()})
    assert scheduler_module.ScheduledBatch().scored_rows == MAX_SCORED_ROWS
    assert max(scored_per_step) == MAX_SCORED_ROWS and sum(scored_per_step) == 2 * 399
    for rid, ids in prompts.items():
        assert_matches(outs[rid][0], ids, hf_prompt_logprobs(hf_tiny, ids), 1)
    assert_all_blocks_free(engine)


def _lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's local-completions reading of an echo + logprobs + max_tokens 1 choice: the
    continuation's summed logprob, and whether each of its tokens was the likeliest."""
    lp = choice["logprobs"]
    tokens, tops = lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]
    return sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops, strict=True))


def test_a_completions_top_logprobs_keep_the_likeliest_of_tokens_sharing_a_text():
    """Byte tokens of one UTF-8 character each decode alone to U+FFFD: a prompt token "\\ufffd"
    whose likeliest alternative is another "\\ufffd" token must not overwrite it in the
    text-keyed dict, where lm-eval's is_greedy (the token's logprob is the dict's best) would
    read the prompt as greedy."""
    from spindle.openai_api.fanout import Answer
    from spindle.openai_api.requests import completion_request
    from spindle.openai_api.responses import CompletionFormat, Reply

    _, call = completion_request({"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 1}, {"m"})
    top = [pb.TopLogprob(token_id=126, logprob=-2.33, token="\ufffd")]
    scores = [
        pb.TokenLogprob(token_id=87, token="x"),
        pb.TokenLogprob(token_id=241, logprob=-2.92, token="\ufffd", top=top),
    ]
    sampled = pb.TokenLogprob(token_id=13, logprob=-0.5, token=".", top=[pb.TopLogprob(token_id=13,
                              logprob=-0.5, token=".")])  # fmt: skip
    chunk = pb.Chunk(token_ids=[13], text=".", prompt_logprobs=scores, logprobs=[sampled])
    answer = Answer(0, [pb.GenerateResponse(chunk=chunk), pb.GenerateResponse(final=pb.Final())])
    (choice,) = Reply(CompletionFormat(), call, "r").whole([(0, answer)], [answer])["choices"]
    assert choice["logprobs"]["top_logprobs"][1] == {"\ufffd": -2.33}
    assert _lm_eval_loglikelihood(choice, 1) == (pytest.approx(-2.92), False)


def test_a_completions_text_offsets_are_where_each_token_starts_in_its_text(smollm2):
    """`text_offset`, OpenAI's and lm-eval's (it cuts the continuation at the context's length):
    the smollm2 tokenizer's own answer, the characters decoded before each token (a token holding
    part of a character at that character), for a whole choice, a stream that brings its text as
    the pod releases it (a partial character held back), and a text a stop string cut short."""
    from spindle.openai_api.responses import CompletionFormat, TextOffsets

    tok = smollm2.tokenizer
    text = "Héllo wörld, 日本語 <|im_start|>ok"
    ids = tok.encode(text)
    lps = [
        pb.TokenLogprob(token_id=i, logprob=-1.0, token=tok.decode([i], skip_special_tokens=False))
        for i in ids
    ]
    prefixes = [tok.decode(ids[:i], skip_special_tokens=False).rstrip("\ufffd") for i in range(len(ids) + 1)]
    want = [len(p) for p in prefixes[:-1]]
    assert "\ufffd" in {lp.token for lp in lps} and "<|im_start|>" in {lp.token for lp in lps}
    assert CompletionFormat().choice(text, lps, None)["logprobs"]["text_offset"] == want
    streamed = TextOffsets()
    got = [streamed.more([lp], prefixes[i + 1][len(prefixes[i]) :])[0] for i, lp in enumerate(lps)]
    assert got == want
    cut = text.index("日")
    assert TextOffsets().whole(lps, text[:cut]) == [min(w, cut) for w in want]


def test_lm_evals_default_loglikelihood_request_of_token_ids_equals_hf(spindle_up, smollm2, hf_smollm2):
    """lm-eval's local-completions sends token ids by default (`tokenized_requests`), a batch of
    prompts each with its continuation, with echo, logprobs 1 and max_tokens 1, and reads each
    choice's `token_logprobs[ctxlen:-1]`: `echo` of token ids was refused. Each choice's text
    is now its prompt decoded by the pod, and lm-eval's reading is HF's."""
    import openai

    tok = smollm2.tokenizer
    client = openai.OpenAI(base_url=spindle_up.http, api_key="none", max_retries=0)
    pairs = [("The capital of France is", " Paris"), ("Héllo wörld,", " 日本語")]
    contexts = [tok.encode(c) for c, _ in pairs]
    prompts = [tok.encode(c + x) for c, x in pairs]
    assert all(p[: len(c)] == c for p, c in zip(prompts, contexts, strict=True))
    out = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    for choice, ids, ctx in zip(out.choices, prompts, contexts, strict=True):
        assert choice.text.startswith(tok.decode(ids, skip_special_tokens=False))
        assert len(choice.logprobs.token_logprobs) == len(ids) + 1
        ref = hf_prompt_logprobs(hf_smollm2, ids)[len(ctx) - 1 :]
        cont = torch.tensor(ids[len(ctx) :])
        want = ref.gather(1, cont[:, None]).sum().item(), bool((ref.argmax(-1) == cont).all())
        got = _lm_eval_loglikelihood(choice.model_dump(), len(ctx))
        assert got == (pytest.approx(want[0], abs=1e-3), want[1])
    streamed = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompts[:1], echo=True, max_tokens=1, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_the_pod_echoes_a_prompt_once_and_refuses_what_it_cannot_write(smollm2):
    from model_service.pod import wire

    tok = smollm2.tokenizer
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 504, 3458]), echo_prompt=True)
    assert wire.prompt_text(req, tok) == tok.decode([1, 504, 3458], skip_special_tokens=False)
    assert wire.prompt_text(pb.GenerateRequest(text="a b", echo_prompt=True), None) == "a b"
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        wire.prompt_text(req, None)
    req.resume.output_token_ids.append(5)  # resumed: its caller has the prompt's text already
    assert wire.prompt_text(req, tok) is None
    chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user")]), echo_prompt=True)
    with pytest.raises(InvalidRequestError, match="chat"):
        wire.prompt_text(chat, tok)
