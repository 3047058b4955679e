"""Tool-call grammars and the calls read back (chat.tool_grammar, chat.parse_tool_calls) on the
real tokenizers of Qwen2.5 (its own ``<tool_call>`` token) and the embedded Gemma 3 (the default
format in text): under ``auto`` a call begun in any of the forms small models write (the
template's tag, the other tags, a code fence, a bare JSON object, after some text or not) is
completed under the call grammar and read back; text that holds no opener stays text; an echoed
tool definition is steered to a call; ``none`` and ``required`` keep their formats."""
from __future__ import annotations

import json

import pytest

from selectinfer_ros.core.execution.chat import (CALL_FORMS, chat_of, parse_tool_calls,
                                                 starts_call, tool_format, tool_grammar)
from selectinfer_ros.core.execution.constrain import Grammars
from selectinfer_ros.core.format.tokenizer import load_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "navigate_to", "description": "Drive to a room.",
    "parameters": {"type": "object", "properties": {"room": {"type": "string"},
                                                    "speed": {"type": "number"}},
                   "required": ["room"]}}},
         {"type": "function", "function": {"name": "stop", "description": "Stop.",
                                           "parameters": {"type": "object", "properties": {}}}}]
CALL = '{"name": "navigate_to", "arguments": {"room": "kitchen", "speed": 0.5}}'


@pytest.fixture(scope="module", params=["qwen", "gemma"])
def grammars(request, qwen05, embedded):
    tok = load_tokenizer(qwen05 if request.param == "qwen" else embedded)
    eos = [tok.convert_tokens_to_ids("<|im_end|>")] if request.param == "qwen" else [1, 106]
    g = Grammars(tok, len(tok), eos)
    g.lltokenizer()
    return g


def _consume(g: Grammars, grammar: str, text: str):
    """(constraint, tokens consumed, tokens of text) after feeding ``text`` as the tokenizer
    splits it (special tokens as such)."""
    c = g.constraint("grammar", grammar)
    ids = g.tokenizer(text, add_special_tokens=False)["input_ids"]
    return c, c.matcher.try_consume_tokens(ids), len(ids)


def _auto(g: Grammars, choice: str = "auto") -> str:
    chat = chat_of([{"role": "user", "content": "Go to the kitchen."}], TOOLS, choice)
    return tool_grammar(chat, tool_format(g.tokenizer))


def test_calls_in_every_form_complete_and_read_back(grammars):
    fmt = tool_format(grammars.tokenizer)
    grammar = _auto(grammars)
    forms = [f"{o}\n{CALL}\n{c}" for o, c in CALL_FORMS] + [
        f"I will drive there. {CALL_FORMS[1][0]} {CALL} {CALL_FORMS[1][1]}",
        f"```json\n{CALL}\n```", CALL]
    for text in forms:
        c, n, total = _consume(grammars, grammar, text)
        assert n == total and c.matcher.is_accepting(), (fmt, text, n, total)
        calls = parse_tool_calls(text)
        assert [(k.name, k.value) for k in calls] == [("navigate_to",
                                                       {"room": "kitchen", "speed": 0.5})], text
        assert starts_call(text) and calls[0].id.startswith("call_")


def test_text_stays_text_and_an_echoed_definition_becomes_a_call(grammars):
    grammar = _auto(grammars)
    for text in ("The kitchen is left of the hall.", 'Use {"room": 1} in JSON, not YAML.'):
        c, n, total = _consume(grammars, grammar, text)
        assert n == total and c.matcher.is_accepting() and not parse_tool_calls(text)
        assert c.closing_path(4) is not None  # EOS ends it
    # the model echoing its tools' list: after the opener only a call's JSON is allowed
    echo = '<tools> {"type": "function", "function": {"name": "navigate_to"}}'
    c, n, total = _consume(grammars, grammar, echo)
    prefix = grammars.tokenizer.decode(
        grammars.tokenizer(echo, add_special_tokens=False)["input_ids"][:n])
    assert n < total and prefix.startswith("<tools>") and '"type"' not in prefix
    closing = c.closing_path(64)  # and the call can still end
    assert closing is not None
    done = prefix + grammars.tokenizer.decode(closing, skip_special_tokens=True)
    assert parse_tool_calls(done)[0].name in ("navigate_to", "stop")


def test_none_and_required_keep_their_formats(grammars):
    fmt = tool_format(grammars.tokenizer)
    none = _auto(grammars, "none")
    for text in (CALL, f"{CALL_FORMS[1][0]} {CALL}"):
        _, n, total = _consume(grammars, none, text)
        assert n < total, text
    required = _auto(grammars, "required")
    opener = "<tool_call>" if fmt.call_token else json.dumps("<tool_call>")
    assert required.startswith("start: " + opener)
    native = f"<tool_call>\n{CALL}\n</tool_call>"
    c, n, total = _consume(grammars, required, native)
    assert n == total and c.matcher.is_stopped()
    _, n, total = _consume(grammars, required, "The kitchen.")
    assert n == 0
