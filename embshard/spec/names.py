"""Names that become file names, and text from files printed safely: the rules checkpoints and serving artifacts share
(no torch)."""

from __future__ import annotations

NAME_BYTES = 200
"""Longest name (UTF-8 bytes) that becomes a file name: room for the suffixes export adds within 255."""


def escape(text: str) -> str:
    """`text` with every character that is not printable (terminal escapes, other controls, bidi marks) written
    as a Python escape (`\\x1b`); line breaks are kept."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == "\n" else ascii(c)[1:-1] for c in text)


def is_plain_name(name: object) -> bool:
    """Whether `name` is a plain file name: a non-empty printable string of at most NAME_BYTES bytes, without `/`,
    `\\` or NUL, and not `.` or `..`."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and name.isprintable()
        and not any(c in name for c in "/\\\0")
        and len(name.encode("utf-8", "surrogatepass")) <= NAME_BYTES
    )
