"""The one error type a user sees: its message is a single line saying what went wrong and how to fix it.

The CLI prints `error: <message>` and exits non-zero; anything else escaping is a bug in llmx.
"""


class LlmxError(Exception):
    """A problem with the user's input or machine (bad file, bad option, plan that cannot fit)."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): enough to say
    why something failed in a one-line message."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def shown(text: str) -> str:
    """A name read from a file as a one-line message can show it: itself when printable, else its
    repr (a damaged file's names may hold newlines and control characters)."""
    return text if text.isprintable() else repr(text)
