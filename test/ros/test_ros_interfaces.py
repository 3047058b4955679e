"""The generated selectinfer_msgs types: import, fields, constants, CDR round trip."""
import pytest
from rclpy.serialization import deserialize_message, serialize_message

from builtin_interfaces.msg import Time
from selectinfer_msgs.action import Generate
from selectinfer_msgs.msg import ActiveProfile, ChatMessage, ChatTool, ToolCall
from selectinfer_msgs.srv import ReloadBase, SwitchProfile

RESULT_CODES = {
    'NONE': 0,
    'UNKNOWN': 9000,
    'INVALID_GOAL': 9001,
    'UNKNOWN_TASK': 9002,
    'PROMPT_TOO_LONG': 9003,
    'QUEUE_FULL': 9004,
    'PROFILE_SWITCH_FAILED': 9005,
    'GENERATION_FAILED': 9006,
    'NO_MODEL': 9007,
    'CANCELED': 9008,
}


def _fields(msg_type):
    return dict(msg_type.get_fields_and_field_types())


def test_generate_goal_fields():
    assert _fields(Generate.Goal) == {
        'prompt': 'string',
        'task': 'string',
        'max_new_tokens': 'uint32',
        'temperature': 'float',
        'top_k': 'int32',
        'top_p': 'float',
        'repetition_penalty': 'float',
        'seed': 'int64',
        'stop': 'sequence<string>',
        'use_chat_template': 'boolean',
        'compute_ratio': 'float',
        'choices': 'sequence<string>',
        'length_normalize': 'boolean',
        'json_schema': 'string',
        'grammar': 'string',
        'messages': 'sequence<selectinfer_msgs/ChatMessage>',
        'tools': 'sequence<selectinfer_msgs/ChatTool>',
        'tool_choice': 'string',
    }


def test_generate_result_and_feedback_fields():
    assert _fields(Generate.Result) == {
        'error_code': 'uint16',
        'error_msg': 'string',
        'text': 'string',
        'finish_reason': 'string',
        'parsed': 'boolean',
        'closed_early': 'boolean',
        'warnings': 'sequence<string>',
        'prompt_tokens': 'uint32',
        'generated_tokens': 'uint32',
        'time_to_first_token': 'double',
        'tokens_per_second': 'double',
        'profile': 'string',
        'load_ratio': 'float',
        'compute_ratio': 'float',
        'choice_index': 'int32',
        'choice_logprobs': 'sequence<float>',
        'choice_logprobs_normalized': 'sequence<float>',
        'tool_calls': 'sequence<selectinfer_msgs/ToolCall>',
        'cached_tokens': 'uint32',
    }
    assert _fields(Generate.Feedback) == {
        'text_delta': 'string',
        'generated_tokens': 'uint32',
        'tokens_per_second': 'double',
    }


@pytest.mark.parametrize('name,value', sorted(RESULT_CODES.items()))
def test_result_constants(name, value):
    assert getattr(Generate.Result, name) == value


def test_service_and_message_fields():
    assert _fields(SwitchProfile.Request) == {'task': 'string'}
    assert _fields(SwitchProfile.Response) == {
        'success': 'boolean', 'message': 'string', 'active_task': 'string',
        'reload_seconds': 'double', 'bytes_read': 'uint64', 'neurons_read': 'uint32',
        'neurons_retiered': 'uint32',
    }
    assert _fields(ReloadBase.Request) == {'task': 'string', 'timeout': 'double'}
    assert _fields(ReloadBase.Response) == {
        'success': 'boolean', 'message': 'string', 'active_task': 'string',
        'reload_seconds': 'double', 'bytes_read': 'uint64', 'neurons_read': 'uint32',
        'neurons_retiered': 'uint32',
    }
    assert _fields(ChatMessage) == {'role': 'string', 'content': 'string',
                                     'tool_calls': 'sequence<selectinfer_msgs/ToolCall>',
                                     'tool_call_id': 'string'}
    assert _fields(ChatTool) == {'name': 'string', 'description': 'string', 'parameters': 'string'}
    assert _fields(ToolCall) == {'id': 'string', 'name': 'string', 'arguments': 'string'}
    assert _fields(ActiveProfile) == {
        'task': 'string', 'model_id': 'string', 'load_ratio': 'float',
        'static_ratio': 'float', 'stamp': 'builtin_interfaces/Time',
    }


# float32 fields use values exactly representable in binary32, so equality holds.
SAMPLES = [
    Generate.Goal(
        prompt='Pick up the red cup.\nThen stop.', task='manipulation', max_new_tokens=48,
        temperature=0.75, top_k=40, top_p=0.875, repetition_penalty=1.25, seed=-1,
        stop=['\n\n', 'User:', 'ünïcødé ✓'], use_chat_template=True, compute_ratio=0.5),
    Generate.Goal(prompt='Which room next?', choices=['kitchen', 'hall', 'dock', 'ünï'],
                  length_normalize=True),
    Generate.Result(
        error_code=Generate.Result.CANCELED, error_msg='canceled by client',
        text='partial text', finish_reason='canceled', prompt_tokens=12,
        generated_tokens=3, time_to_first_token=0.123456789, tokens_per_second=42.5,
        profile='navigation', load_ratio=0.375, compute_ratio=0.25),
    Generate.Result(text='hall', finish_reason='choice', choice_index=1,
                    choice_logprobs=[-2.5, -0.125, -4.0], choice_logprobs_normalized=[-1.25, -0.125, -2.0]),
    Generate.Goal(messages=[
        ChatMessage(role='system', content='You are a robot.'),
        ChatMessage(role='user', content='Go to the kitchen ✓'),
        ChatMessage(role='assistant', tool_calls=[
            ToolCall(id='call_1', name='navigate_to', arguments='{"room": "kitchen"}')]),
        ChatMessage(role='tool', content='arrived', tool_call_id='call_1')],
        tools=[ChatTool(name='navigate_to', description='drive to a room',
                        parameters='{"type": "object"}')], tool_choice='required'),
    Generate.Result(text='<tool_call>...', finish_reason='tool_calls', parsed=True,
                    tool_calls=[ToolCall(id='call_2', name='say', arguments='{"text": "hi"}')],
                    cached_tokens=600),
    Generate.Feedback(text_delta=' word', generated_tokens=7, tokens_per_second=13.25),
    SwitchProfile.Request(task='navigation'),
    SwitchProfile.Response(success=True, message='ok', active_task='navigation',
                           reload_seconds=0.0625, bytes_read=2**40 + 3),
    ReloadBase.Request(task='qa'),
    ReloadBase.Response(success=False, message='unknown task', active_task='navigation',
                        reload_seconds=1.5, bytes_read=123456789, neurons_read=36864,
                        neurons_retiered=512),
    ActiveProfile(task='qa', model_id='gemma-3-270m', load_ratio=0.625, static_ratio=0.125,
                  stamp=Time(sec=1_700_000_000, nanosec=999_999_999)),
]


@pytest.mark.parametrize('msg', SAMPLES, ids=lambda m: type(m).__qualname__)
def test_serialization_round_trip(msg):
    data = serialize_message(msg)
    assert isinstance(data, bytes) and len(data) > 4
    back = deserialize_message(data, type(msg))
    assert back == msg
    for field in msg.get_fields_and_field_types():
        assert getattr(back, field) == getattr(msg, field), field


def test_defaults_are_zero():
    goal = Generate.Goal()
    assert goal.prompt == '' and goal.task == ''
    assert goal.max_new_tokens == 0 and goal.compute_ratio == 0.0
    assert list(goal.stop) == []
    assert list(goal.choices) == [] and goal.length_normalize is False
    result = Generate.Result()
    assert result.error_code == Generate.Result.NONE
    assert result.choice_index == -1 and list(result.choice_logprobs) == []
