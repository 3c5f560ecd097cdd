"""The one error type a user sees: its message is a single line saying what went wrong and how to fix it.

The CLI prints `error: <message>` and exits non-zero; anything else escaping is a bug in llmx.
"""


class LlmxError(Exception):
    """A problem with the user's input or machine (bad file, bad option, plan that cannot fit)."""
