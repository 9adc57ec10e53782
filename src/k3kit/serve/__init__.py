"""k3kit.serve: `k3kit serve`, an OpenAI-compatible HTTP server over one loaded model (FastAPI + uvicorn).

scheduler  the contract between the HTTP side and whatever runs the model: GenerationRequest in,
           an async stream of TokenEvent / FinishEvent out, cancel(request_id), stats()
sequence   one sequence's output as its client sees it: stop ids and stop strings, max_tokens,
           incremental UTF-8 text, logprobs (model-neutral; every scheduler uses it)
serial     SerialScheduler, phase 1: ONE worker thread owns the model and runs ONE request at a
           time, in arrival order, from a bounded queue
api        the OpenAI request bodies (pydantic, strict) and their checks -> GenerationRequest
app        the FastAPI application: routes, OpenAI error shapes, API key, body size limit, SSE
metrics    the Prometheus collector behind GET /metrics
server     bind, load the model in the background (GET /health answers 503 meanwhile), run uvicorn

Phase 1 serializes requests: one loaded K3 model holds one sequence state, so concurrent clients
wait in the queue and are served one after another. Phase 2 (several sequence states, rows of
many sequences in one target pass through the shared RoutedMoE) replaces only `serial` by a
batching scheduler with the same interface.

Layer rule: imports adapters, runtime, tokenizer, gguf, errors, _io, progress; never commands or mini
(the CLI resolves "the shipped mini model" and hands in a path).
"""
