"""OpenAI's chat request shapes as the model's chat template sees them (issue 54): developer and
function messages shown as the roles they stand for, tool calls of earlier turns rendered where
the template shows them and refused where it does not, text content parts joined, content null
beside tool calls. On the default model's own template (Qwen2.5's, which drops any role it does
not name) and on templates built here; the same through HTTP on the tiny app:
test_serve_hostile_input.py."""

import json

import pytest

from deployments.http.openai_api import BodyError, ChatRequest, parse_body
from fly_serve.engine.params import ParamError
from fly_serve.engine.prompts import chat_text
from fly_serve.loading.tiny import tiny_tokenizer

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
# A template that names its roles, as most models' do, and shows no tool calls
NAMED_ROLES = (
    "{% for m in messages %}{% if m['role'] in ('system', 'user', 'assistant') %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def qwen():
    from fly_serve.loading.loading import load_tokenizer
    from fly_serve.loading.weights import DEFAULT_TARGET

    return load_tokenizer(DEFAULT_TARGET, progress=lambda *a: None)


def rendered(tokenizer, *messages: dict) -> str:
    body = parse_body(json.dumps({"messages": list(messages)}).encode(), ChatRequest)
    return chat_text(tokenizer, [m.for_template() for m in body.messages])


def test_a_developer_message_is_qwens_system_message(qwen):
    user = {"role": "user", "content": "Hi."}
    as_system = rendered(qwen, {"role": "system", "content": "Answer in French."}, user)
    assert rendered(qwen, {"role": "developer", "content": "Answer in French."}, user) == as_system
    assert "Answer in French." in as_system


def test_an_assistant_turns_tool_calls_and_the_tools_answer_are_rendered(qwen):
    text = rendered(
        qwen,
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
        {"role": "function", "name": "get_time", "content": "12:01"},
    )
    # the arguments as the JSON object the model wrote, not a quoted string of it
    assert '{"name": "get_time", "arguments": {"tz": "UTC"}}' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text and "<tool_response>\n12:01\n</tool_response>" in text


def test_text_parts_are_joined_and_other_parts_named():
    tok = tiny_tokenizer()
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert rendered(tok, {"role": "user", "content": parts}) == rendered(tok, {"role": "user", "content": "a\nb"})
    refusal = [{"type": "refusal", "refusal": "I cannot."}]
    assert "I cannot." in rendered(tok, {"role": "user", "content": "x"}, {"role": "assistant", "content": refusal})
    for content, param in (
        ([{"type": "input_audio", "input_audio": {}}], "messages.0.content.0.type"),
        ([{"type": "refusal", "refusal": "no"}], "messages.0.content.0.type"),  # a user does not refuse
        ([{"type": "text"}], "messages.0.content.0"),
        ([], "messages.0.content"),
        (None, "messages.0.content"),
    ):
        with pytest.raises(BodyError) as e:
            rendered(tok, {"role": "user", "content": content})
        assert e.value.param == param, e.value.message


def test_what_a_template_would_leave_out_is_refused_naming_it():
    tok = tiny_tokenizer()
    tok.chat_template = NAMED_ROLES
    user = {"role": "user", "content": "What time is it?"}
    with pytest.raises(ParamError) as e:
        rendered(tok, user, {"role": "assistant", "content": None, "tool_calls": [CALL]})
    assert e.value.field == "messages.1.tool_calls"
    with pytest.raises(ParamError) as e:
        rendered(tok, user, {"role": "tool", "content": "12:00", "tool_call_id": "call_1"})
    assert e.value.field == "messages.1.role" and "'tool'" in e.value.message
    assert "<|im_start|>system\nBe brief." in rendered(tok, {"role": "developer", "content": "Be brief."}, user)


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "tool", "content": "12:00"}, "messages.0.tool_call_id"),
        ({"role": "function", "content": "12:00"}, "messages.0.name"),
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "messages.0.tool_calls"),
        ({"role": "assistant", "content": None}, "messages.0.content"),
        ({"role": "assistant", "content": None, "function_call": {"name": "f"}}, "messages.0.function_call"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{**CALL, "type": "custom"}]},
            "messages.0.tool_calls.0.type",
        ),
    ],
)
def test_what_openai_refuses_of_a_message_is_a_400_naming_it(message, param):
    with pytest.raises(BodyError) as e:
        parse_body(json.dumps({"messages": [message]}).encode(), ChatRequest)
    assert e.value.param == (f"messages.0.{param}" if param == "function_call" else param), e.value.message
