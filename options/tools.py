"""Tool calling in multi-turn rollouts: the model calls Python functions between its turns and reads
their results. This file holds loading the functions (`file.py:fn_a,fn_b`), their JSON schemas for
the chat template, which tool-call format the template uses, reading the calls out of one model
turn, running one call within a timeout, and `ToolEnvironment`, the environment the multi-turn loop
(options/environments.py) calls once per model turn. The loop, tokenization and rewards live
elsewhere.

A tool is a plain function (or `async def`) with a type hint on every argument and a Google-style
docstring: transformers' `get_json_schema` turns it into the schema the model is shown.

    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. "2 * (3 + 4)"
        '''

Formats (`template_style` finds which one the model's chat template writes):

    hermes   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, one tag per call,
             anywhere in the turn (Qwen2.5, Qwen3, Hermes and many others)
    llama3   {"name": "f", "parameters": {...}} as the turn itself, optionally after
             <|python_tag|> (text before the tag is ignored); several calls separated by ";"
             (what vLLM's llama3_json parser reads); text after the last call is not a call

Either style also takes the other's key ("parameters" for hermes, "arguments" for llama3), and a
call without arguments means no arguments.
"""

import asyncio
import contextlib
import inspect
import json
import re
import sys
import threading
from dataclasses import dataclass, field

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import (DocstringParsingException,
                                                    TypeHintParsingException)

from plumbing import user_code
from plumbing.config import fail

STYLES = ("hermes", "llama3")


# ---------------------------------------------------------------------------------------------
# Loading the tools and their schemas
# ---------------------------------------------------------------------------------------------

def load_tools(spec):
    """'path/to/file.py:fn_a,fn_b' -> [fn_a, fn_b]. Anything that would only break later (a file
    that does not import, a name that is not a function, a function the model cannot be shown
    because its schema cannot be built) stops here with one line."""
    source, _, names = spec.rpartition(":")
    if not source.endswith(".py") or not names:
        fail(f"tools {spec!r}: give FILE.py:FUNCTION, or FILE.py:FUNCTION,FUNCTION,...")
    module = import_file(source)
    funcs = []
    for name in [n.strip() for n in names.split(",")]:
        if not hasattr(module, name):
            fail(f"tool file {source} has no function {name!r}")
        func = getattr(module, name)
        if not callable(func):
            fail(f"tool {name} in {source} is a {type(func).__name__}, not a function")
        if tool_name(func) in [tool_name(f) for f in funcs]:
            # the model calls a tool by its __name__, not by the name it is listed under
            alias = f" ({name} is {tool_name(func)})" if name != tool_name(func) else ""
            fail(f"tools {spec!r}: two tools are named {tool_name(func)}{alias}, the name the "
                 "model calls a tool by; list each function once")
        tool_schema(func)
        funcs.append(func)
    return funcs


def import_file(source, what="tool"):
    """The module of a .py file, imported by path, once a run (user_code.load); one line naming the
    file and the line if the file does not exist or raises while it is imported."""
    try:
        return user_code.load(source, what)
    except ValueError as e:
        fail(str(e))


def tool_schema(func):
    """get_json_schema(func), or one line naming the function and what its definition needs."""
    name = tool_name(func)
    try:
        return get_json_schema(func)
    except TypeHintParsingException as e:
        missing = re.search(r"Argument (\w+) is missing a type hint", str(e))
        if missing:
            fail(f"tool {name}: argument {missing[1]!r} has no type hint; annotate every argument "
                 f"(e.g. {missing[1]}: str): its JSON schema, which the model is shown, needs them")
        fail(f"tool {name}: a type hint has no JSON schema ({' '.join(map(str, e.args))}); use "
             "str, int, float, bool, list, dict, Literal, or unions and lists of these")
    except DocstringParsingException as e:
        missing = re.search(r"no description for the argument '(\w+)'", str(e))
        if missing:
            fail(f"tool {name}: its docstring does not describe argument {missing[1]!r}; add it "
                 f"under 'Args:' as a line '{missing[1]}: what it is'")
        fail(f"tool {name} has no docstring; add one (a line saying what it does, then 'Args:' "
             "with a 'name: description' line per argument): the model reads it as the tool's "
             "description")
    except Exception as e:  # noqa: BLE001 (e.g. a type hint naming a class that is not defined)
        fail(f"tool {name}: cannot build its JSON schema: {type(e).__name__}: {e}")


def tool_name(func):
    """The name the model calls a tool by: the one get_json_schema writes in its schema."""
    return getattr(func, "__name__", "operation")


def tool_schemas(funcs):
    """The functions' JSON schemas, for `tokenizer.apply_chat_template(..., tools=...)`."""
    return [tool_schema(f) for f in funcs]


# ---------------------------------------------------------------------------------------------
# Which format the chat template writes
# ---------------------------------------------------------------------------------------------

# a call and its result the template must render, with values no template writes by itself
PROBE_CALL = {"name": "lookup_7f3a", "arguments": {"query_7f3a": "value_7f3a"}}
PROBE_RESULT = "result_7f3a"
# the start of each style's call, to read the rendered probe from (hermes: the tag)
CALL_START = {"hermes": "<tool_call>", "llama3": '{"name"'}


def template_style(tokenizer):
    """'hermes' or 'llama3': the format of the tokenizer's chat template, found by rendering a tool
    call and reading it back with `parse_tool_calls` (so the parser reads what the template
    writes). One line, before any model loads, if the template has no tool support, drops the
    call or its result, or writes calls in another format. (It need not be prefix-preserving:
    environments.MultiTurn renders tool results on their own, after a stand-in turn.)"""
    model = tokenizer.name_or_path or "this tokenizer"
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: apply_chat_template takes tool_use with tools
        template = template.get("tool_use") or template.get("default")
    if not template or not re.search(r"\btools\b", template):
        fail(f"the chat template of {model} does not use `tools`: tool calling needs a model "
             "whose chat template supports tools (e.g. Qwen2.5-Instruct, Llama-3.1-Instruct)")
    tool_calls = [{"type": "function", "function": PROBE_CALL}]
    conversation = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "tool_calls": tool_calls},
                    {"role": "tool", "name": PROBE_CALL["name"], "content": PROBE_RESULT}]
    try:
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception as e:  # noqa: BLE001 (jinja's TemplateError, or a TypeError on dict arguments)
        fail(f"the chat template of {model} cannot render a tool call and its result "
             f"({type(e).__name__}: {e}): tool calling needs a template with tool support")
    if PROBE_RESULT not in rendered or not all(s in rendered for s in PROBE_CALL["arguments"]):
        fail(f"the chat template of {model} drops an assistant's tool call or the tool's result "
             "when it renders them: tool calling needs a template with tool support")
    # read from the last place a call of that style could start (-1: the last character)
    styles = [s for s in STYLES
              if PROBE_CALL in parse_tool_calls(rendered[rendered.rfind(CALL_START[s]):], s)[0]]
    if not styles:
        fail(f"the chat template of {model} writes tool calls in a format this file does not read "
             f"(it reads hermes <tool_call> JSON and Llama 3 JSON): {rendered[-300:]!r}")
    return styles[0]


# ---------------------------------------------------------------------------------------------
# Reading the calls out of one model turn
# ---------------------------------------------------------------------------------------------

@dataclass
class ParsedCall:
    """One call as the model wrote it: name and arguments, or what is wrong with it (then name is
    the best guess, "unknown" if none)."""
    name: str
    arguments: dict | None = None
    error: str | None = None


def parse_tool_calls(text, style):
    """One assistant turn -> (calls [{"name", "arguments"}], one error string per malformed call).
    A turn without calls -> ([], [])."""
    parsed = parse_turn(text, style)
    calls = [{"name": p.name, "arguments": p.arguments} for p in parsed if p.error is None]
    return calls, [p.error for p in parsed if p.error is not None]


def parse_turn(text, style):
    """The turn's calls, well-formed and malformed, in the order it wrote them."""
    if style == "hermes":
        return hermes_calls(text)
    if style == "llama3":
        return llama3_calls(text)
    raise ValueError(f"unknown tool-call style {style!r}: one of {', '.join(STYLES)}")


HERMES_TAG = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


def hermes_calls(text):
    """One call per <tool_call> tag; a tag the turn never closed is malformed (it was cut off)."""
    calls = []
    for number, match in enumerate(HERMES_TAG.finditer(text), 1):
        if not match[2]:
            calls.append(ParsedCall(guess_name(match[1]), error=f"tool call {number}: <tool_call> "
                                    "is not closed by </tool_call>"))
            continue
        body = match[1].strip()
        try:
            calls.append(call_from_json(json.loads(body), number))
        except json.JSONDecodeError as e:
            calls.append(bad_json(body, number, e))
    return calls


PYTHON_TAG = "<|python_tag|>"


def llama3_calls(text):
    """The calls of a turn that is JSON (after <|python_tag|>, or from its first character):
    objects separated by ';'. Bad JSON ends the reading: where the next call starts is unknown."""
    if PYTHON_TAG in text:
        rest = text[text.index(PYTHON_TAG) + len(PYTHON_TAG):]
    elif text.lstrip().startswith("{"):
        rest = text
    else:
        return []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        at = skip_space(rest, at)
        try:
            value, end = decoder.raw_decode(rest, at)
        except json.JSONDecodeError as e:
            calls.append(bad_json(rest[at:], len(calls) + 1, e, start=at))
            return calls
        calls.append(call_from_json(value, len(calls) + 1))
        at = skip_space(rest, end)
        if not rest.startswith(";", at) or skip_space(rest, at + 1) == len(rest):
            return calls
        at += 1


def skip_space(text, at):
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def call_from_json(value, number):
    """A decoded call -> ParsedCall, with an error if it is not {"name": str, "arguments": {}}."""
    if not isinstance(value, dict):
        return ParsedCall("unknown", error=f"tool call {number} is {json_kind(value)}, not a JSON "
                          'object {"name": ..., "arguments": {...}}')
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall("unknown", error=f'tool call {number} has no "name" (a string)')
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return ParsedCall(name, error=f"tool call {number} ({name}): its arguments are "
                          f"{json_kind(arguments)}, not a JSON object")
    return ParsedCall(name, arguments)


def bad_json(body, number, error, start=0):
    """A call that does not decode; `start`: where body begins in the text the error counts in."""
    return ParsedCall(guess_name(body), error=f"tool call {number} is not valid JSON ({error.msg} "
                      f"at character {error.pos - start}): {body[:200]}")


def guess_name(body):
    found = re.search(r'"name"\s*:\s*"([^"]+)"', body)
    return found[1] if found else "unknown"


def json_kind(value):
    kinds = {str: "a string", bool: "a boolean", int: "a number", float: "a number",
             list: "an array", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


# ---------------------------------------------------------------------------------------------
# Running one call
# ---------------------------------------------------------------------------------------------

class ToolTimeout(Exception):
    """An async tool that did not finish in time (told apart from a TimeoutError of its own)."""


def call_tool(funcs_by_name, call, timeout):
    """Run {"name", "arguments"} -> (result text, failed). A failure is text the model reads (an
    unknown name, arguments that do not fit, an exception inside, no result within `timeout`
    seconds), e.g. "error: calculator raised ZeroDivisionError: division by zero"."""
    name, arguments = call["name"], call.get("arguments") or {}
    if name not in funcs_by_name:
        return f"error: unknown tool {name!r}; the tools are {', '.join(funcs_by_name)}", True
    func = funcs_by_name[name]
    try:
        inspect.signature(func).bind(**arguments)
    except TypeError as e:  # missing, unexpected or repeated arguments
        return f"error: {name} got arguments it does not take: {e}", True
    except ValueError:  # no signature to check (some builtins): the call itself will tell
        pass
    outcome = in_thread(lambda: run_tool(func, arguments, timeout), timeout, f"tool {name!r}")
    if not outcome or isinstance(outcome.get("error"), ToolTimeout):
        return f"error: {name} did not return within {timeout:g} s", True
    if "error" in outcome:
        error = outcome["error"]
        if isinstance(error, SystemExit):
            return f"error: {name} called sys.exit({error.code!r})", True
        return f"error: {name} raised {type(error).__name__}: {error}", True
    return result_text(outcome["value"], name), False


def run_tool(func, arguments, timeout):
    """func(**arguments); an async one on a private event loop, cancelled after `timeout` s."""
    result = func(**arguments)
    if not inspect.isawaitable(result):
        return result

    async def bounded():
        task = asyncio.ensure_future(result)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            task.cancel()
            raise ToolTimeout
        return task.result()

    return asyncio.run(bounded())


def in_thread(call, timeout, who=None):
    """call() in a daemon thread, waited for `timeout` seconds: {"value": v}, {"error": e}, or {}
    when it did not return. A sync call that never returns cannot be stopped, only abandoned (a
    daemon thread does not hold the exit); an async one is cancelled by run_tool. who: the user
    code it is ("tool 'calculator'"), whose changes to the process are taken back."""
    outcome = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 (reported to the model, SystemExit included)
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="rloo-tool")
    with user_code.taken_back(who) if who else contextlib.nullcontext():
        thread.start()
        thread.join(timeout)
    return outcome if not thread.is_alive() else {}


def result_text(value, name="tool"):
    """What the model reads: a string as it is, anything else as JSON (arrays and tensors as their
    lists); what JSON cannot hold as its str(), with a warning naming the tool, once per tool and
    type, since the model then reads a repr the tool's author likely never meant it to."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=as_json)
    except (TypeError, ValueError):
        if (name, type(value)) not in warned:
            warned.add((name, type(value)))
            print(f"rloo: WARNING: tool {name} returned a {type(value).__name__}, which is neither "
                  f"text nor JSON: the model reads its str(), {str(value)[:60]!r}; return a str "
                  "or JSON data (dict, list, number)", file=sys.stderr)
        return str(value)


warned = set()  # (tool name, result type) already warned about


def as_json(value):
    """json.dumps's fallback: numpy arrays and scalars, tensors, as their lists or numbers."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


# ---------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------

@dataclass
class ToolEnvironment:
    """One trajectory's tools: `step` after each model turn runs the turn's calls and returns one
    tool message per call. `tool_calls` counts every call attempted (malformed ones too) and
    `tool_failures` those that failed; the multi-turn loop logs both.

    The budget: a turn whose calls would take `tool_calls` past `max_tool_calls` ends the
    trajectory (done, no messages) without running any of them, since the model would never
    read their results. A turn that uses the budget up exactly still gets its results, so the
    model can answer from them; its next call ends the trajectory."""
    funcs: list
    style: str
    max_tool_calls: int
    timeout: float = 10.0
    tool_calls: int = 0
    tool_failures: int = 0
    owner: object = None  # a TRL environment whose methods funcs are (environments.adapt)
    template_kwargs: dict = field(default_factory=dict)  # {"tools": schemas} shown in its prompt

    def step(self, assistant_text):
        """The model's turn -> (tool messages, done). No call: ([], True), the model answered.
        Calls run one after another, each within `timeout` s, in the order the turn wrote them."""
        parsed = parse_turn(assistant_text, self.style)
        if not parsed or self.tool_calls + len(parsed) > self.max_tool_calls:
            return [], True
        funcs_by_name = {tool_name(f): f for f in self.funcs}
        messages = []
        for call in parsed:
            if call.error is None:
                content, failed = call_tool(funcs_by_name, {"name": call.name,
                                                            "arguments": call.arguments},
                                            self.timeout)
            else:
                content, failed = f"error: {call.error}", True
            self.tool_calls += 1
            self.tool_failures += int(failed)
            messages.append({"role": "tool", "name": call.name, "content": content})
        return messages, False


def tool_environment(funcs, style, max_tool_calls, timeout=10.0):
    """The factory the multi-turn loop calls once per trajectory with its dataset row (unused:
    the tools are the same for every row): a fresh ToolEnvironment, counters at zero."""
    return lambda row: ToolEnvironment(list(funcs), style, max_tool_calls, timeout)
