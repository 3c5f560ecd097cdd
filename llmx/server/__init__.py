"""`llmx serve`: an OpenAI-compatible HTTP API over one loaded model.

- `protocol`: request parsing and response shapes (pure, no HTTP);
- `app`: the FastAPI application: /v1/chat/completions, /v1/completions (both with `stream`),
  /v1/models, /health. One sequence is generated at a time; later requests wait their turn.
"""
