"""Escape sequences in text typed on a command line (as llama.cpp's ``--escape``, its default).

``bash`` keeps ``\\n`` inside double quotes, so ``"Question: ...\\nAnswer:"`` reaches a program
with a backslash and an ``n``. Commands that take a prompt turn ``\\n \\t \\r \\\\ \\" \\'`` and
``\\xHH`` into the characters they name (``--no-escape`` keeps the text as typed).
"""
from __future__ import annotations

import re

_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|[ntr\\\"'])")


def process_escapes(text: str) -> str:
    """``text`` with the escape sequences above replaced; any other backslash stays."""
    def sub(m: re.Match) -> str:
        code = m.group(1)
        return chr(int(code[1:], 16)) if code[0] == "x" else _SIMPLE[code]
    return _ESCAPE.sub(sub, text)
