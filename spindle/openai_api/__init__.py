"""OpenAI's HTTP API (chat completions, completions, responses, models) in front of a Generation servicer.

One implementation for the gateway and the model pods: an HTTP request becomes the same
`GenerateRequest` a gRPC caller would send and goes through the same servicer method
(`Generate`, `ListModels`), so authentication, limits, routing, retries, resume, tracing and
metrics are the gRPC path's own. Torch-free, like the gateway.

- `requests.py`: OpenAI's JSON body -> `GenerateRequest` (what is refused, and how);
- `responses.py`: `GenerateResponse` messages -> OpenAI's JSON objects and stream chunks;
- `responses_input.py`, `responses_output.py`: the Responses API (/v1/responses) as a chat underneath;
- `tools.py`, `tool_parsers.py`: tool calling's request side, and the calls read from the output;
- `reasoning_parsers.py`: a reasoning model's thinking read apart from its answer;
- `fanout.py`: one request's several generations (`n`, prompts, `best_of`) as `Generate` streams;
- `errors.py`: gRPC status -> HTTP status and OpenAI's error JSON;
- `context.py`: the part of a gRPC servicer context the servicers use, for an HTTP call;
- `server.py`: the aiohttp server and its routes.
"""
