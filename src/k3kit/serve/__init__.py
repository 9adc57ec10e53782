"""k3kit.serve: `k3kit serve`, an OpenAI-compatible HTTP server over one loaded model (FastAPI + uvicorn).

scheduler  the contract between the HTTP side and whatever runs the model: GenerationRequest in,
           an async stream of TokenEvent / FinishEvent out, cancel(request_id), stats()
sequence   one sequence's output as its client sees it: stop ids and stop strings, max_tokens,
           incremental UTF-8 text, logprobs (model-neutral; every scheduler uses it)
batch      BatchScheduler: continuous batching over several sequence states of a BatchedModel
           (each pass: the next row of every decoding sequence + prefill chunks of new ones;
           with --draft, a request served alone decodes speculatively)
serial     SerialScheduler: ONE request at a time, in arrival order, from a bounded queue (models
           without several sequence states)
api        the OpenAI request bodies (pydantic, strict) and their checks -> GenerationRequest
app        the FastAPI application: routes, OpenAI error shapes, API key, body size limit, SSE
metrics    the Prometheus collector behind GET /metrics
server     bind, load the model in the background (GET /health answers 503 meanwhile), run uvicorn

A model with several sequence states (k3kit.runtime.protocols.BatchedModel, e.g. the K3 adapter)
is served by `batch`: rows of many sequences share one target pass through the shared RoutedMoE,
and a request's greedy output is the same whoever else is served (batch invariance, see batch).
With `--draft`, a request alone decodes speculatively and joins the shared passes when others come.

Layer rule: imports adapters, runtime, tokenizer, gguf, errors, _io, progress; never commands or mini
(the CLI resolves "the shipped mini model" and hands in a path).
"""
