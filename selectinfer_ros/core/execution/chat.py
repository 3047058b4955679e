"""Conversations: chat messages and tools rendered with the model's own chat template, the
grammar that constrains an answer's tool calls, and the calls read back from the answer.

ROS-free. A :class:`Chat` is messages (roles system, user, assistant, tool), tools (a name, a
description, a JSON schema of the arguments) and ``tool_choice`` (auto: text or calls, none:
text, required: calls, or one tool's name). :func:`render` gives the prompt's token ids: the same
ids as transformers' ``apply_chat_template(messages, tools=..., add_generation_prompt=True,
tokenize=True)``.

Tool-call format (:class:`ToolFormat`): where the model's template renders tools itself and writes
calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Hermes), the
template renders tools, calls in the history and tool results, and the calls are generated in that
format (``<tool_call>`` as the model's own token where it has one). Any other template gets the
same format as a documented default: the tools and the instructions (:data:`DEFAULT_TOOLS_TEXT`)
are appended to the system message (one is added first when there is none), an assistant
message's calls are written into its content and tool results are sent as user messages
``<tool_response>\\n...\\n</tool_response>``.

The answer is constrained (llguidance, :mod:`.constrain`) by :func:`tool_grammar`: each call is
one of the tools with arguments valid under its schema (JSON written as the templates' ``tojson``
writes it: ``", "`` and ``": "``), one call per answer (then the end of the turn: small models
given the choice repeated their call until cut off; the tool's result comes back as a tool
message and the next answer may call again); ``auto`` also allows a text answer (one that does
not start with a call, ``{`` or a code fence: a call without its markers), ``none`` only text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")
MAX_MESSAGES = 256
MAX_TOOLS = 32
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# JSON as Python's json.dumps and the templates' tojson write it: what the model has seen
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A call the model begins in one of its own forms (auto) may be laid out as it writes it: Qwen2.5
# writes ```json fences pretty-printed, and forced compact JSON there made it echo a schema's
# "type" as a value
FREE_STYLE = {"whitespace_flexible": True}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_PROBE = "selectinfer_probe_tool"

DEFAULT_TOOLS_TEXT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n"
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object as text)."""

    name: str
    arguments: str = "{}"
    id: str = ""

    @property
    def value(self) -> dict:
        """The arguments, parsed."""
        return json.loads(self.arguments)


@dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


@dataclass(frozen=True)
class Tool:
    """A function the model may call; ``parameters`` is the JSON schema of its arguments as text
    (empty: no arguments)."""

    name: str
    description: str = ""
    parameters: str = ""

    @property
    def schema(self) -> dict:
        return json.loads(self.parameters) if self.parameters.strip() else dict(NO_ARGUMENTS)

    def as_dict(self) -> dict:
        """The tool as chat templates take it (OpenAI's function format)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.schema}}


@dataclass(frozen=True)
class Chat:
    """A conversation to answer, with the tools the answer may call."""

    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"

    @property
    def calls_allowed(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def chars(self) -> int:
        """Characters of every message, call and tool (bounds the work before rendering)."""
        n = sum(len(m.role) + len(m.content) + len(m.tool_call_id) +
                sum(len(c.name) + len(c.arguments) + len(c.id) for c in m.tool_calls)
                for m in self.messages)
        return n + sum(len(t.name) + len(t.description) + len(t.parameters) for t in self.tools)

    def validate(self) -> None:
        """ValueError with the reason unless the conversation is well formed: known roles, calls
        on assistant messages with JSON-object arguments, tools with valid names (unique) and
        object schemas, a tool_choice that names a mode or a tool."""
        if not self.messages:
            raise ValueError("no messages")
        if len(self.messages) > MAX_MESSAGES:
            raise ValueError(f"{len(self.messages)} messages; at most {MAX_MESSAGES}")
        for i, m in enumerate(self.messages):
            if m.role not in ROLES:
                raise ValueError(f"message {i}: unknown role {m.role[:32]!r}; roles: "
                                 f"{', '.join(ROLES)}")
            if m.tool_calls and m.role != "assistant":
                raise ValueError(f"message {i}: only assistant messages carry tool calls")
            for c in m.tool_calls:
                if not c.name:
                    raise ValueError(f"message {i}: a tool call without a name")
                _json_object(c.arguments, f"message {i}: the arguments of call {c.name[:64]!r}")
        if len(self.tools) > MAX_TOOLS:
            raise ValueError(f"{len(self.tools)} tools; at most {MAX_TOOLS}")
        seen = set()
        for t in self.tools:
            if not TOOL_NAME.fullmatch(t.name):
                raise ValueError(f"tool name {t.name[:80]!r}: use 1 to 64 letters, digits, _ "
                                 "or -")
            if t.name in seen:
                raise ValueError(f"tool {t.name!r} is given twice")
            seen.add(t.name)
            if t.parameters.strip():
                schema = _json_object(t.parameters, f"tool {t.name!r}: parameters")
                if schema.get("type", "object") != "object":
                    raise ValueError(f"tool {t.name!r}: parameters must be an object schema, "
                                     f"got type {schema.get('type')!r}")
        choice = self.tool_choice
        if choice in ("auto", "none"):
            return
        if not self.tools:
            raise ValueError(f"tool_choice {choice[:64]!r} needs tools")
        if choice != "required" and choice not in seen:
            raise ValueError(f"tool_choice {choice[:64]!r} is neither auto, none, required nor a "
                             f"tool; tools: {', '.join(sorted(seen))}")


def _json_object(text: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _get(obj: Any, name: str, default: Any = "") -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def _text(value: Any) -> str:
    """A schema or arguments given as text or as a JSON value (a dict from a messages file)."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call(obj: Any) -> ToolCall:
    fn = _get(obj, "function", None) or obj  # OpenAI's {"type": "function", "function": {...}}
    return ToolCall(str(_get(fn, "name")), _text(_get(fn, "arguments", "{}")) or "{}",
                    str(_get(obj, "id", "") or ""))


def _tool(obj: Any) -> Tool:
    fn = _get(obj, "function", None) or obj
    return Tool(str(_get(fn, "name")), str(_get(fn, "description", "") or ""),
                _text(_get(fn, "parameters", "")))


def chat_of(messages: Any, tools: Any = (), tool_choice: str = "") -> Chat:
    """A Chat from messages and tools given as objects with the fields of the Generate goal's
    (ROS messages) or as dicts (OpenAI's format: a messages file); not yet validated."""
    msgs = tuple(Message(str(_get(m, "role")), str(_get(m, "content", "") or ""),
                         tuple(_call(c) for c in (_get(m, "tool_calls", None) or ())),
                         str(_get(m, "tool_call_id", "") or ""))
                 for m in messages)
    return Chat(msgs, tuple(_tool(t) for t in tools or ()), (tool_choice or "auto").strip())


def goal_chat(goal: Any) -> Chat | None:
    """The conversation of a Generate goal (None when it gives a prompt instead)."""
    messages = getattr(goal, "messages", None)
    if not messages:
        return None
    return chat_of(messages, getattr(goal, "tools", ()), getattr(goal, "tool_choice", ""))


# ---- the model's format ------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    """How a model's tokenizer takes tools: ``native`` when its template renders them and the
    calls itself; ``call_token`` when ``<tool_call>`` / ``</tool_call>`` are tokens of its own."""

    native: bool
    call_token: bool


def has_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def tool_format(tok) -> ToolFormat:
    """The tool format of ``tok`` (see the module docstring)."""
    native = False
    if has_template(tok) and CALL_OPEN in str(tok.chat_template):
        probe = Tool(_PROBE, "probe").as_dict()
        try:
            text = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[probe],
                                           add_generation_prompt=True, tokenize=False)
            native = _PROBE in text
        except Exception:  # noqa: BLE001 - a template that refuses tools has no native format
            native = False
    call_token = all(len(tok(t, add_special_tokens=False)["input_ids"]) == 1
                     for t in (CALL_OPEN, CALL_CLOSE))
    return ToolFormat(native, call_token)


def call_text(call: ToolCall) -> str:
    """A call as the default format (and Qwen2.5's template) writes it."""
    args = json.dumps(call.value, ensure_ascii=False)
    return f'{CALL_OPEN}\n{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": ' \
           f'{args}}}\n{CALL_CLOSE}'


def template_messages(chat: Chat, fmt: ToolFormat) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as ``apply_chat_template`` takes them for ``fmt``."""
    if fmt.native:
        out = []
        for m in chat.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                d["tool_calls"] = [{"type": "function", **({"id": c.id} if c.id else {}),
                                    "function": {"name": c.name, "arguments": c.value}}
                                   for c in m.tool_calls]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out, [t.as_dict() for t in chat.tools] or None
    out = []
    for m in chat.messages:
        if m.role == "tool":
            text = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].get("tool_result"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_result": True})
            continue
        content = "\n".join([m.content] * bool(m.content) + [call_text(c) for c in m.tool_calls])
        out.append({"role": m.role, "content": content})
    for d in out:
        d.pop("tool_result", None)
    if chat.tools:
        block = DEFAULT_TOOLS_TEXT.format(tools="".join(
            "\n" + json.dumps(t.as_dict(), ensure_ascii=False) for t in chat.tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


@dataclass
class Rendered:
    """A rendered conversation: its token ids and ``marks``, positions where a prefix shared by
    other conversations ends (the system message and the tools), for the prompt cache."""

    ids: list[int]
    marks: tuple[int, ...] = ()
    text: str = ""
    format: ToolFormat | None = None


def _control_text(tok, contents: list[str]) -> bool:
    specials = [s for s in getattr(tok, "all_special_tokens", []) if s]
    return any(s in c for c in contents for s in specials)


def _tokens(tok, msgs: list[dict], tools, generation: bool, special_tokens: bool) -> tuple[list[int], str]:
    try:
        text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=generation,
                                       tokenize=False)
    except Exception as e:  # noqa: BLE001 - the template's own checks (roles must alternate, ...)
        raise ValueError(f"the chat template refused the conversation: "
                         f"{type(e).__name__}: {str(e)[:300]}") from None
    hostile = {i: m["content"] for i, m in enumerate(msgs)
               if not special_tokens and _control_text(tok, [m["content"]])}
    if not hostile:
        return tok(text, add_special_tokens=False)["input_ids"], text  # as apply_chat_template
    # control tokens typed in a message are plain text: such a content is tokenized on its own
    slots = {f"\x00selectinfer-{i}\x00": c for i, c in hostile.items()}
    marked = [dict(m, content=f"\x00selectinfer-{i}\x00") if i in hostile else m
              for i, m in enumerate(msgs)]
    skeleton = tok.apply_chat_template(marked, tools=tools, add_generation_prompt=generation,
                                       tokenize=False)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(re.escape(s) for s in slots) + ")", skeleton):
        if piece in slots:
            ids += tok(slots[piece], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tok(piece, add_special_tokens=False)["input_ids"]
    return ids, text


def render(tok, chat: Chat, fmt: ToolFormat | None = None, special_tokens: bool = False) -> Rendered:
    """The prompt of ``chat`` (with the generation prompt) as token ids; ValueError when the
    model has no chat template or its template refuses the conversation. Control tokens typed in
    a message (``<|im_end|>``, ...) stay plain text unless ``special_tokens``."""
    if not has_template(tok):
        raise ValueError("this model's tokenizer has no chat template (a base model): send a "
                         "prompt instead of messages")
    fmt = fmt or tool_format(tok)
    msgs, tools = template_messages(chat, fmt)
    ids, text = _tokens(tok, msgs, tools, True, special_tokens)
    marks = ()
    lead = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
    if 0 < lead < len(msgs):  # the system message (and the tools): shared by an agent's goals
        head, _ = _tokens(tok, msgs[:lead], tools, False, special_tokens)
        if 0 < len(head) < len(ids) and ids[:len(head)] == head:
            marks = (len(head),)
    return Rendered(ids, marks, text, fmt)


# ---- the answer's grammar and its calls ------------------------------------------------------
def _call_schema(tool: Tool, style: dict = JSON_STYLE) -> dict:
    """The JSON schema of one call of ``tool``: its name, then its arguments (the arguments'
    ``$defs``/``definitions`` lifted to the root, where their ``#/...`` references point)."""
    params = tool.schema
    root: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        if key in params:
            params = dict(params)
            root[key] = params.pop(key)
    root.update({"type": "object", "properties": {"name": {"const": tool.name},
                                                  "arguments": params},
                 "required": ["name", "arguments"], "additionalProperties": False,
                 "x-guidance": style})
    return root


# The forms in which a model begins a call under ``tool_choice`` auto besides its template's own
# ``<tool_call>`` token: an opening text and the text that closes the call. A call begun in any of
# them is completed under the call grammar (the opener acts as a lazy grammar's trigger); an
# answer that starts with ``{`` is a bare call. Measured on BFCL (docs/results/
# structured-answers.md) with Qwen2.5-Coder 1.5B: as plain transformers (dense float) it wrote 59
# of 60 calls in a ```json fence and one bare; through the node before these forms were read,
# where a text could not start with a fence, it wrote <tools> (27), ```json (14) and <response>
# (8). The other tags are the Hermes-style forms llama.cpp's parsers accept.
CALL_FORMS: tuple[tuple[str, str], ...] = (
    (CALL_OPEN, CALL_CLOSE), ("<tools>", "</tools>"), ("<function_call>", "</function_call>"),
    ("<response>", "</response>"), ("<json>", "</json>"), ("```", "```"))


def _lark_regex(text: str) -> str:
    return "".join("\\" + c if c in "\\/.^$*+?()[]{}|-" else c for c in text)


def tool_grammar(chat: Chat, fmt: ToolFormat) -> str | None:
    """The Lark grammar (llguidance's) of an answer to ``chat``, or None when it has no tools.

    ``required`` and a named tool: one call in the template's format. ``auto``: a text answer (one
    that holds none of the :data:`CALL_FORMS` openers and does not start with ``{``), or one call
    begun in any of those forms (after text, or a bare JSON object at the start), completed under
    the call grammar and closed by the form's closer. ``none``: text only."""
    if not chat.tools:
        return None
    opener, closer = (("<tool_call>", "</tool_call>") if fmt.call_token
                      else (json.dumps(CALL_OPEN), json.dumps(CALL_CLOSE)))
    triggers = "|".join(_lark_regex(o) for o, _ in CALL_FORMS)
    # TEXT: no call opener anywhere, not starting with "{" (nor, for none, a code fence)
    text = f'TEXT: /(?s:.+)/ & ~/(?s:.*)({triggers})(?s:.*)/ & ~/[ \\t\\r\\n]*\\{{(?s:.*)/'
    if chat.tool_choice == "none":
        return "start: TEXT\n" + text + "\n"
    tools = [t for t in chat.tools if chat.tool_choice in ("auto", "required", t.name)]
    lines = ["json_call: " + " | ".join(f"call_{i}" for i in range(len(tools)))] + [
        f'call_{i}: %json {json.dumps(_call_schema(t), ensure_ascii=False)}'
        for i, t in enumerate(tools)]
    native = f'{opener} "\\n" json_call "\\n" {closer}'
    if chat.tool_choice != "auto":
        return "\n".join(["start: " + native] + lines) + "\n"
    forms = [f"TEXT? {native}"] if fmt.call_token else []
    lines += ["free_call: " + " | ".join(f"free_{i}" for i in range(len(tools)))] + [
        f'free_{i}: %json {json.dumps(_call_schema(t, FREE_STYLE), ensure_ascii=False)}'
        for i, t in enumerate(tools)]  # laid out as the model writes it
    for i, (o, c) in enumerate(CALL_FORMS):  # lazy: the lead ends with the opener's first match
        lang = '"json"? ' if o == "```" else ""  # a fence names its language or not
        forms.append(f"lead_{i} {lang}WS? free_call WS? {json.dumps(c)}")
        lines += [f"lead_{i}[lazy]: LEAD_{i}",
                  f"LEAD_{i}: /(?s:.*){_lark_regex(o)}/ & ~/[ \\t\\r\\n]*\\{{(?s:.*)/"]
    forms.append("WS? free_call")
    lines += [text, "WS: /[ \\t\\r\\n]{1,4}/"]
    return "\n".join(["start: TEXT | call", "call: " + " | ".join(forms)] + lines) + "\n"


def starts_call(text: str) -> bool:
    """Whether an answer (complete or cut off) begins a call: it holds an opener of
    :data:`CALL_FORMS`, or starts with ``{``."""
    return text.lstrip().startswith("{") or any(o in text for o, _ in CALL_FORMS)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The call in an answer ``text``: the JSON object ``{"name": ..., "arguments": ...}`` after
    the first opener of :data:`CALL_FORMS`, or at the start; its id is ``call_<12 hex digits>``.
    An answer holds at most one call (:func:`tool_grammar`); none: a text answer."""
    starts = [(i + len(o), o) for o, _ in CALL_FORMS if (i := text.find(o)) >= 0]
    if starts:
        at = min(starts)[0]
    elif text.lstrip().startswith("{"):
        at = len(text) - len(text.lstrip())
    else:
        return []
    if text.startswith("json", at) and text[at - 3:at] == "```":
        at += 4  # a fence's language
    at += len(text[at:]) - len(text[at:].lstrip())
    try:
        value, _ = json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        return []
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return []
    args = value.get("arguments", {})
    return [ToolCall(value["name"], json.dumps(args, ensure_ascii=False),
                     f"call_{uuid.uuid4().hex[:12]}")]


def messages_file(value: Any) -> Chat:
    """A Chat from a messages file's JSON: a list of messages, or an object with ``messages``,
    ``tools`` and ``tool_choice`` (OpenAI's chat-completions fields)."""
    if isinstance(value, list):
        return chat_of(value)
    if not isinstance(value, dict) or "messages" not in value:
        raise ValueError("a messages file holds a JSON list of messages or an object with "
                         "'messages' (and 'tools', 'tool_choice')")
    choice = value.get("tool_choice") or ""
    if isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}}
        choice = _get(choice.get("function", choice), "name")
    return chat_of(value["messages"], value.get("tools") or (), str(choice))


__all__ = ["Chat", "Message", "Rendered", "Tool", "ToolCall", "ToolFormat", "chat_of",
           "goal_chat", "messages_file", "parse_tool_calls", "render", "starts_call", "tool_format",
           "tool_grammar"]
