"""The names of the server's batched-step counters (`metrics.Metrics`), in a module of their own so that
a client reading them back (`llmx.bench.serve_steps`) needs neither torch nor the engine."""

STEPS = "llmx_batch_steps"  # batched steps run
PROMPT_STEPS = "llmx_batch_prompt_steps"  # those that carried a prompt chunk
SECONDS = "llmx_batch_step_seconds"  # their time, by part
PROMPT_SECONDS = "llmx_batch_prompt_step_seconds"  # the prompt steps' time, by part
