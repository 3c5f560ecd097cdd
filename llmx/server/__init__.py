"""`llmx serve`: an OpenAI-compatible HTTP API over one loaded model.

- `protocol`: request parsing and response shapes (pure, no HTTP);
- `app`: the FastAPI application and its routes; `choices`: a request's choices as a whole body or a stream;
- `worker`: the engine's owner on the loading thread, one sequence at a time; `scheduler`: with `-np N`, up
  to N sequences in batched steps over the paged KV cache;
- `generation`, `metrics`, `errors`, `page`: one reply's tokens, the Prometheus counters, OpenAI's error
  shape, the chat page at `/`; `step_metrics`: the batched-step counters' names, which bench-serve reads back.
"""
