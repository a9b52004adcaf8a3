"""options/tools.py: loading tool functions (one line per bad file or function), their schemas, reading
calls out of a model turn (hermes and Llama 3 JSON), running one call (errors, timeouts, async),
ToolEnvironment's counters and budget, and the real Qwen2.5 / Llama 3.1 / 3.2 / Qwen3 chat
templates: which format each writes, how it renders tool results, and whether a model turn renders
the same once tool results follow it (the multi-turn loop takes the difference as the reply)."""

import string
import time

import pytest
from chat_templates import LLAMA3_1, LLAMA3_2, NO_TOOLS, QWEN2_5, QWEN3
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from options import tools

TOOLS_FILE = '''
import asyncio


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


async def shout(text: str, times: int = 1) -> str:
    """Say it louder.

    Args:
        text: what to say
        times: how many times
    """
    await asyncio.sleep(0)
    return (text.upper() + " ") * times


NOT_A_FUNCTION = 3


def no_hint(a) -> int:
    """Missing a hint.

    Args:
        a: something
    """


def no_doc(a: int) -> int:
    return a


def undescribed(a: int, b: int) -> int:
    """Describes only a.

    Args:
        a: something
    """
'''


def write(tmp_path, source, name="my_tools.py"):
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def failure(call):
    """The one line a `config.fail` stops with (it raises SystemExit('error: ...'))."""
    with pytest.raises(SystemExit) as stopped:
        call()
    message = stopped.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------
# load_tools, tool_schemas
# ---------------------------------------------------------------------------------------------

def test_load_tools_returns_the_named_sync_and_async_functions(tmp_path):
    path = write(tmp_path, TOOLS_FILE)
    add, shout = tools.load_tools(f"{path}:add, shout")
    assert (add.__name__, add(2, 3)) == ("add", 5)
    assert shout.__name__ == "shout"


@pytest.mark.parametrize("names, expected", [
    ("missing", ["has no function 'missing'"]),
    ("NOT_A_FUNCTION", ["NOT_A_FUNCTION", "is a int, not a function"]),
    ("no_hint", ["tool no_hint", "argument 'a' has no type hint"]),
    ("no_doc", ["tool no_doc has no docstring", "Args:"]),
    ("undescribed", ["tool undescribed", "does not describe argument 'b'", "Args:"]),
    ("add,add", ["two tools are named add"]),
])
def test_load_tools_names_each_bad_function_in_one_line(tmp_path, names, expected):
    path = write(tmp_path, TOOLS_FILE)
    message = failure(lambda: tools.load_tools(f"{path}:{names}"))
    assert all(part in message for part in expected), message


def test_load_tools_rejects_a_spec_without_file_and_function(tmp_path):
    assert "FILE.py:FUNCTION" in failure(lambda: tools.load_tools("add"))
    assert "FILE.py:FUNCTION" in failure(lambda: tools.load_tools(f"{tmp_path}/t.py:"))


def test_load_tools_names_a_missing_file(tmp_path):
    message = failure(lambda: tools.load_tools(f"{tmp_path}/nope.py:add"))
    assert "nope.py" in message and "does not exist" in message


def test_load_tools_names_the_file_and_line_of_a_syntax_error(tmp_path):
    path = write(tmp_path, "x = 1\ndef broken(:\n    pass\n")
    message = failure(lambda: tools.load_tools(f"{path}:broken"))
    assert path in message and "SyntaxError" in message and "line 2" in message


def test_load_tools_names_the_file_and_line_that_raised_at_import(tmp_path):
    path = write(tmp_path, "import os\n\nvalue = 1 / 0\n")
    message = failure(lambda: tools.load_tools(f"{path}:value"))
    assert path in message and "line 3" in message and "ZeroDivisionError" in message


def test_tool_schemas_describe_names_types_and_arguments(tmp_path):
    funcs = tools.load_tools(write(tmp_path, TOOLS_FILE) + ":add,shout")
    add, shout = [s["function"] for s in tools.tool_schemas(funcs)]
    assert add["name"] == "add" and add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first"}
    assert add["parameters"]["required"] == ["a", "b"]
    assert shout["parameters"]["properties"]["times"]["type"] == "integer"
    assert shout["parameters"]["required"] == ["text"]  # times has a default


# ---------------------------------------------------------------------------------------------
# parse_tool_calls
# ---------------------------------------------------------------------------------------------

def test_hermes_one_call_inside_surrounding_text():
    text = ('Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call>\nDone?')
    assert tools.parse_tool_calls(text, "hermes") == ([{"name": "add",
                                                        "arguments": {"a": 1, "b": 2}}], [])


def test_hermes_two_calls_in_one_turn_in_order():
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "shout", "arguments": {"text": "hi"}}\n</tool_call>')
    calls, errors = tools.parse_tool_calls(text, "hermes")
    assert [c["name"] for c in calls] == ["add", "shout"] and errors == []


def test_hermes_no_call_is_empty():
    assert tools.parse_tool_calls("The answer is 3.", "hermes") == ([], [])


@pytest.mark.parametrize("body, expected", [
    ('{"name": "add", "arguments": {"a": 1,}}', "not valid JSON"),
    ('{"arguments": {"a": 1}}', 'has no "name"'),
    ('{"name": "add", "arguments": "a=1"}', "arguments are a string, not a JSON object"),
    ('["add", 1]', "is an array, not a JSON object"),
])
def test_hermes_malformed_call_is_one_error_and_the_good_ones_still_count(body, expected):
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    calls, errors = tools.parse_tool_calls(f"{good}\n<tool_call>\n{body}\n</tool_call>", "hermes")
    assert calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert len(errors) == 1 and errors[0].startswith("tool call 2") and expected in errors[0]


def test_hermes_unclosed_tag_is_an_error():
    calls, errors = tools.parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {}}',
                                           "hermes")
    assert calls == [] and "not closed" in errors[0]


def test_llama3_bare_json_with_parameters():
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert tools.parse_tool_calls(text, "llama3") == ([{"name": "add",
                                                        "arguments": {"a": 1, "b": 2}}], [])


def test_llama3_after_python_tag_several_calls_separated_by_semicolons():
    text = ('Checking. <|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
            '{"name": "shout", "arguments": {"text": "a;b"}}')
    calls, errors = tools.parse_tool_calls(text, "llama3")
    assert calls == [{"name": "add", "arguments": {"a": 1, "b": 2}},
                     {"name": "shout", "arguments": {"text": "a;b"}}] and errors == []


def test_llama3_prose_is_no_call():
    assert tools.parse_tool_calls("The sum is {3}.", "llama3") == ([], [])


@pytest.mark.parametrize("text, expected", [
    ('{"name": "add", "parameters": {"a": 1}', "not valid JSON"),
    ('<|python_tag|>', "not valid JSON"),
    ('{"parameters": {"a": 1}}', 'has no "name"'),
    ('{"name": "add", "parameters": [1, 2]}', "arguments are an array"),
])
def test_llama3_malformed_call_is_an_error(text, expected):
    calls, errors = tools.parse_tool_calls(text, "llama3")
    assert calls == [] and len(errors) == 1 and expected in errors[0]


def test_unknown_style_is_refused():
    with pytest.raises(ValueError, match="hermes, llama3"):
        tools.parse_tool_calls("", "mistral")


# ---------------------------------------------------------------------------------------------
# call_tool
# ---------------------------------------------------------------------------------------------

def divide(a: float, b: float) -> float:
    """Divide.

    Args:
        a: numerator
        b: denominator
    """
    return a / b


async def lookup(key: str) -> dict:
    """Look up.

    Args:
        key: the key
    """
    return {"key": key, "found": True}


def sleepy() -> str:
    """Sleeps."""
    time.sleep(5)
    return "late"


async def async_sleepy() -> str:
    """Sleeps without blocking."""
    import asyncio
    await asyncio.sleep(5)
    return "late"


async def own_timeout() -> str:
    """Raises a TimeoutError of its own, at once."""
    raise TimeoutError("upstream timed out")


FUNCS = {f.__name__: f for f in (divide, lookup, sleepy, async_sleepy, own_timeout)}


def test_call_tool_sync_result_as_json():
    assert tools.call_tool(FUNCS, {"name": "divide", "arguments": {"a": 1, "b": 4}}, 5) == (
        "0.25", False)


def test_call_tool_async_on_its_own_loop():
    result = tools.call_tool(FUNCS, {"name": "lookup", "arguments": {"key": "k"}}, 5)
    assert result == ('{"key": "k", "found": true}', False)


def test_call_tool_result_that_is_not_json_is_its_str():
    funcs = {"obj": lambda: object}
    assert tools.call_tool(funcs, {"name": "obj", "arguments": {}}, 5) == (str(object), False)


@pytest.mark.parametrize("call, expected", [
    ({"name": "divide", "arguments": {"a": 1, "b": 0}},
     "error: divide raised ZeroDivisionError: division by zero"),
    ({"name": "divide", "arguments": {"a": 1}},
     "error: divide got arguments it does not take: missing a required argument: 'b'"),
    ({"name": "divide", "arguments": {"a": 1, "b": 2, "c": 3}},
     "error: divide got arguments it does not take: got an unexpected keyword argument 'c'"),
    ({"name": "nope", "arguments": {}}, "error: unknown tool 'nope'; the tools are divide, "),
    ({"name": "own_timeout", "arguments": {}},
     "error: own_timeout raised TimeoutError: upstream timed out"),
])
def test_call_tool_failure_is_a_message_the_model_reads(call, expected):
    text, failed = tools.call_tool(FUNCS, call, 5)
    assert failed and text.startswith(expected), text


@pytest.mark.parametrize("name", ["sleepy", "async_sleepy"])
def test_call_tool_timeout_holds_for_sync_and_async(name):
    start = time.monotonic()
    text, failed = tools.call_tool(FUNCS, {"name": name, "arguments": {}}, 0.2)
    assert failed and text == f"error: {name} did not return within 0.2 s"
    assert time.monotonic() - start < 3  # the 5 s sleep was not waited for


# ---------------------------------------------------------------------------------------------
# ToolEnvironment
# ---------------------------------------------------------------------------------------------

def counting_tool(calls):
    def note(x: int) -> int:
        """Notes x.

        Args:
            x: a number
        """
        calls.append(x)
        return x
    return note


def hermes_turn(*calls):
    return "\n".join(f"<tool_call>\n{call}\n</tool_call>" for call in calls)


def test_step_without_calls_ends_the_trajectory():
    env = tools.ToolEnvironment([divide], "hermes", max_tool_calls=3)
    assert env.step("It is 0.5.") == ([], True)
    assert (env.tool_calls, env.tool_failures) == (0, 0)


def test_step_answers_every_call_in_order_and_counts_failures():
    env = tools.ToolEnvironment([divide], "hermes", max_tool_calls=5)
    turn = hermes_turn('{"name": "divide", "arguments": {"a": 1, "b": 2}}',
                       '{"name": "divide", "arguments": {"a": 1, "b": 0}}',
                       '{"name": "divide", "arguments": {"a": 1,}}')
    messages, done = env.step(turn)
    assert not done and [m["role"] for m in messages] == ["tool"] * 3
    assert [m["name"] for m in messages] == ["divide"] * 3  # the malformed one's name guessed
    assert messages[0]["content"] == "0.5"
    assert messages[1]["content"].startswith("error: divide raised ZeroDivisionError")
    assert messages[2]["content"].startswith("error: tool call 3 is not valid JSON")
    assert (env.tool_calls, env.tool_failures) == (3, 2)


def test_a_malformed_call_without_a_name_is_answered_as_unknown():
    env = tools.ToolEnvironment([divide], "llama3", max_tool_calls=5)
    messages, done = env.step('{"parameters": {"a": 1}}')
    assert not done and messages[0]["name"] == "unknown"
    assert (env.tool_calls, env.tool_failures) == (1, 1)


def test_budget_used_up_exactly_still_answers_then_the_next_call_ends_unrun():
    ran = []
    env = tools.ToolEnvironment([counting_tool(ran)], "hermes", max_tool_calls=2)
    messages, done = env.step(hermes_turn('{"name": "note", "arguments": {"x": 1}}',
                                          '{"name": "note", "arguments": {"x": 2}}'))
    assert not done and [m["content"] for m in messages] == ["1", "2"]
    assert env.step(hermes_turn('{"name": "note", "arguments": {"x": 3}}')) == ([], True)
    assert ran == [1, 2] and env.tool_calls == 2


def test_a_turn_that_would_exceed_the_budget_runs_none_of_its_calls():
    ran = []
    env = tools.ToolEnvironment([counting_tool(ran)], "hermes", max_tool_calls=2)
    turn = hermes_turn(*[f'{{"name": "note", "arguments": {{"x": {x}}}}}' for x in range(3)])
    assert env.step(turn) == ([], True)
    assert ran == [] and (env.tool_calls, env.tool_failures) == (0, 0)


def test_tool_environment_makes_a_fresh_environment_per_trajectory():
    make_env = tools.tool_environment([divide], "hermes", max_tool_calls=4, timeout=1.0)
    first, second = make_env({"prompt": "a"}), make_env({"prompt": "b"})
    first.step(hermes_turn('{"name": "divide", "arguments": {"a": 1, "b": 1}}'))
    assert (first.tool_calls, second.tool_calls) == (1, 0)
    assert (second.style, second.max_tool_calls, second.timeout) == ("hermes", 4, 1.0)


# ---------------------------------------------------------------------------------------------
# Real chat templates
# ---------------------------------------------------------------------------------------------

def tokenizer_with(template, name="org/model"):
    """A character-level tokenizer (no hub) carrying a real model's chat template."""
    vocab = ["<unk>"] + sorted(set(string.printable))
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                        eos_token="<unk>", name_or_path=name)
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("template, style", [(QWEN2_5, "hermes"), (LLAMA3_1, "llama3"),
                                             (LLAMA3_2, "llama3")],
                         ids=["qwen2.5", "llama3.1", "llama3.2"])
def test_template_style_of_real_templates(template, style):
    assert tools.template_style(tokenizer_with(template)) == style


def test_template_without_tools_is_one_line_naming_the_model():
    message = failure(lambda: tools.template_style(tokenizer_with(NO_TOOLS, "org/plain-chat")))
    assert "org/plain-chat" in message and "does not use `tools`" in message


def test_template_that_drops_tool_messages_is_refused():
    template = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
                "{% if m.role != 'tool' %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}")
    assert "drops" in failure(lambda: tools.template_style(tokenizer_with(template)))


def test_template_with_another_call_format_is_refused():
    template = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
                "{% for c in m.tool_calls or [] %}[CALL] {{ c.function.name }}"
                "({{ c.function.arguments | tojson }}){% endfor %}{{ m.content }}\n{% endfor %}")
    message = failure(lambda: tools.template_style(tokenizer_with(template)))
    assert "format this file does not read" in message


def test_qwen3_template_is_taken_though_not_prefix_preserving():
    # its last assistant turn gets an empty <think> block that a tool message after it removes; the
    # turn loop renders tool results on their own (tests/test_environments.py), so that is no bar
    tokenizer = tokenizer_with(QWEN3, "Qwen/Qwen3-0.6B")
    assert tools.template_style(tokenizer) == "hermes"
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<tool_call>"}]
    after = tokenizer.apply_chat_template(turn + [{"role": "tool", "content": "y"}], tokenize=False)
    assert not after.startswith(tokenizer.apply_chat_template(turn, tokenize=False))


def test_calls_rendered_by_qwen_from_tool_calls_parse_back():
    calls = [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "shout",
                                                              "arguments": {"text": "hi"}}]
    conversation = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": c} for c in calls]}]
    rendered = tokenizer_with(QWEN2_5).apply_chat_template(conversation, tokenize=False)
    assert tools.parse_tool_calls(rendered, "hermes") == (calls, [])


TURNS = {"hermes": 'Sure.\n<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 4}}\n'
                   '</tool_call>',
         "llama3": '{"name": "divide", "parameters": {"a": 1, "b": 4}}'}
# how each template writes the tool's result "0.25" (Llama's JSON-encodes a string content)
RESULTS = {"hermes": "<|im_start|>user\n<tool_response>\n0.25\n</tool_response><|im_end|>\n"
                     "<|im_start|>assistant\n",
           "llama3": '<|start_header_id|>ipython<|end_header_id|>\n\n"0.25"<|eot_id|>'
                     "<|start_header_id|>assistant<|end_header_id|>\n\n"}


def rendered_turn_and_reply(template, text):
    """The conversation up to the model's turn (content = its raw text, no tool_calls field), and
    with the environment's tool messages and the next generation prompt, tools in the prompt."""
    tokenizer = tokenizer_with(template)
    style = tools.template_style(tokenizer)
    schemas = tools.tool_schemas([divide])
    turn = [{"role": "user", "content": "What is 1/4?"}, {"role": "assistant", "content": text}]
    reply, done = tools.ToolEnvironment([divide], style, max_tool_calls=2).step(text)
    assert not done and reply == [{"role": "tool", "name": "divide", "content": "0.25"}]
    before = tokenizer.apply_chat_template(turn, tools=schemas, tokenize=False)
    after = tokenizer.apply_chat_template(turn + reply, tools=schemas, tokenize=False,
                                          add_generation_prompt=True)
    return style, before, after


@pytest.mark.parametrize("template, style", [(QWEN2_5, "hermes"), (LLAMA3_1, "llama3"),
                                             (LLAMA3_2, "llama3")],
                         ids=["qwen2.5", "llama3.1", "llama3.2"])
def test_tool_turn_renders_the_same_once_results_follow_it(template, style):
    text = TURNS[style]
    found, before, after = rendered_turn_and_reply(template, text)
    assert found == style
    # the model's text appears as it wrote it; up to its end, and through the turn's closing
    # (what options/environments.py checks), the rendering with the reply extends the one without
    end_of_text = before.index(text) + len(text)
    assert after.startswith(before[:end_of_text]) and after.startswith(before)
    assert after[len(before):] == RESULTS[style]
    assert '"name": "divide"' in before[:before.index(text)]  # the tools are in the prompt


@pytest.mark.parametrize("template", [LLAMA3_1, LLAMA3_2], ids=["llama3.1", "llama3.2"])
def test_llama_templates_trim_the_turn_and_stay_prefix_preserving(template):
    text = "\n" + TURNS["llama3"] + "\n"
    _, before, after = rendered_turn_and_reply(template, text)
    assert text not in before and TURNS["llama3"] + "<|eot_id|>" in before  # content | trim
    assert after.startswith(before)
