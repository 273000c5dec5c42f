"""Tool turns keep the chat's structure: the model's tool call goes back as an assistant message with ``tool_calls``
(id, function name, arguments) and the result as ``{"role": "tool", "tool_call_id", ...}``, rendered through chat
templates of three model families that validate that structure; a template error drops only its group.

The templates are written here (no Hub access), modelled on the public Qwen2.5, Llama 3.1 and Mistral v0.3
templates: each renders tool calls and results in its family's form and raises (``raise_exception``) on a tool
message that does not carry the id of a call of the assistant message before it, as Mistral's does for ids that
are not 9 alphanumeric characters. The scripted model writes its call in the Hermes form (read by the regex; what
is under test is the chat the rollout builds, not the reply parser).
"""

from __future__ import annotations

import asyncio
import copy

import pytest
from transformers import AutoTokenizer

from grpo_core.config import ModelConfig, RolloutConfig
from grpo_core.models import resolve_model_dir
from grpo_core.rollout.loop import LoopRuntime, RolloutLoop
from grpo_core.rollout.pace import TokenAllowance
from grpo_core.rollout.queue import SampleQueue
from grpo_core.rollout.types import TurnRecord

# Every template starts with this check: a tool message must answer a call of the assistant message before it.
_CHECK_TOOL_IDS = """
{%- set ns = namespace(ids=[]) %}
{%- for message in messages %}
  {%- if message.role == 'assistant' and message.tool_calls %}
    {%- set ns.ids = message.tool_calls | map(attribute='id') | list %}
  {%- elif message.role == 'tool' %}
    {%- if message.tool_call_id is not defined or message.tool_call_id not in ns.ids %}
      {{- raise_exception('A tool message must carry the tool_call_id of a call of the assistant message before it') }}
    {%- endif %}
  {%- endif %}
{%- endfor %}"""

QWEN = (
    _CHECK_TOOL_IDS
    + """
{%- if tools %}
  {{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n\\n<tools>' }}
  {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
  {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
  {%- elif message.role == 'assistant' %}
    {{- '<|im_start|>assistant' }}
    {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
    {%- for tool_call in message.tool_calls %}
      {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
      {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) }}
      {{- '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
)

LLAMA = (
    _CHECK_TOOL_IDS
    + """
{{- '<|begin_of_text|>' }}
{%- if tools %}
  {{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n' }}
  {%- for tool in tools %}{{- (tool | tojson) + '\\n\\n' }}{%- endfor %}
  {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'assistant' and message.tool_calls %}
    {%- if message.tool_calls | length != 1 %}
      {{- raise_exception('This model only supports single tool-calls at once!') }}
    {%- endif %}
    {%- set tool_call = message.tool_calls[0].function %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
    {{- '{"name": "' + tool_call.name + '", "parameters": ' + (tool_call.arguments | tojson) + '}<|eot_id|>' }}
  {%- elif message.role == 'tool' %}
    {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
  {%- else %}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + (message.content | trim) + '<|eot_id|>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""
)

MISTRAL = (
    _CHECK_TOOL_IDS
    + """
{{- '<s>' }}
{%- for message in messages %}
  {%- if message.role == 'user' %}
    {%- if tools and loop.first %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
    {{- '[INST] ' + message.content + '[/INST]' }}
  {%- elif message.role == 'assistant' and message.tool_calls %}
    {{- '[TOOL_CALLS] [' }}
    {%- for tool_call in message.tool_calls %}
      {%- if tool_call.id is not string or tool_call.id | length != 9 %}
        {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
      {%- endif %}
      {{- '{"name": "' + tool_call.function.name + '", "arguments": ' + (tool_call.function.arguments | tojson) }}
      {{- ', "id": "' + tool_call.id + '"}' }}
      {%- if not loop.last %}{{- ', ' }}{%- endif %}
    {%- endfor %}
    {{- ']</s>' }}
  {%- elif message.role == 'assistant' %}
    {{- ' ' + message.content + '</s>' }}
  {%- elif message.role == 'tool' %}
    {%- if message.tool_call_id | length != 9 %}
      {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
    {%- endif %}
    {{- '[TOOL_RESULTS] {"content": ' + (message.content | tojson) + ', "call_id": "' + message.tool_call_id }}
    {{- '"}[/TOOL_RESULTS]' }}
  {%- else %}
    {{- raise_exception('Only user, assistant and tool roles are supported!') }}
  {%- endif %}
{%- endfor %}"""
)

#: How each family renders the call ``add(a=2, b=3)`` (id call00000) and its result 5, from the template's format.
EXPECTED = {
    "qwen": [
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ],
    "llama": [
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>',
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|><|start_header_id|>assistant<|end_header_id|>",
    ],
    "mistral": [
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "call00000"}]</s>',
        '[TOOL_RESULTS] {"content": "5", "call_id": "call00000"}[/TOOL_RESULTS]',
    ],
}
TEMPLATES = {"qwen": QWEN, "llama": LLAMA, "mistral": MISTRAL}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    return a + b


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class ScriptedToolTurns(RolloutLoop):
    """The model calls ``add(2, 3)`` first (when the question asks for a tool), then answers; records each prompt
    the chat template rendered."""

    def __init__(self, config, runtime):
        super().__init__(config, runtime)
        self.rendered: list[str] = []
        self.completions: list[list] = []  # each scored group's completions

    def compute_advantages(self, group):
        self.completions.append(group.completions)
        return super().compute_advantages(group)

    def render_text(self, messages, tool_schemas_=None):
        text = super().render_text(messages, tool_schemas_)
        self.rendered.append(text)
        return text

    async def generate_one_turn(self, prompt_ids):
        prompt = self.tokenizer.decode(prompt_ids)
        # The question holds no digit 5: a prompt with one holds the tool's answer, so this is the second turn.
        text = CALL if "use the tool" in prompt and "5" not in prompt else "The sum is 5."
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, output_log_probs=[-0.5] * len(ids), text=text)


@pytest.fixture(scope="module")
def base_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig(name="tiny-qwen3")))


def _loop(tokenizer, template: str) -> ScriptedToolTurns:
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    cfg = RolloutConfig(num_generations=2, num_sampler_logprobs=0, max_failed_groups=5, shuffle=False)
    allowance = TokenAllowance(cfg.max_staleness, 1 << 20)
    runtime = LoopRuntime(
        tokenizer=tokenizer,
        server=None,
        model_name="m",
        max_model_len=4096,
        dataset=[],
        queue=SampleQueue(allowance, with_topk=False),
        allowance=allowance,
        tools=[add],
    )
    return ScriptedToolTurns(cfg, runtime)


def _run_groups(loop: ScriptedToolTurns, questions: list[str]) -> dict[str, float]:
    async def go():
        try:
            for i, question in enumerate(questions):
                await loop.run_group(i, i, 0, {"prompt": [{"role": "user", "content": question}]})
        finally:
            loop.executor.shutdown(wait=False)

    asyncio.run(go())
    return loop.window.drain()


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_tool_turns_render_as_structured_calls_and_results(base_tokenizer, family):
    # On the code before: the tool message had no tool_call_id and the call was plain text, so every template
    # raised on the second turn, and the run ended.
    loop = _loop(base_tokenizer, TEMPLATES[family])
    metrics = _run_groups(loop, ["What is two plus three? Please use the tool."])
    assert "rollout/failed_group_count" not in metrics and "rollout/template_error_count" not in metrics
    assert metrics["tools/add/call_count"] == 2  # one call per rollout, both answered
    second_turns = [text for text in loop.rendered if "call00000" in text or "5" in text]
    assert len(second_turns) == 2  # the second turn of each rollout rendered
    for text in second_turns:
        for piece in EXPECTED[family]:
            assert piece in text
    call = {"id": "call00000", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    for completion in loop.completions[0]:
        assert completion == [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call00000", "name": "add", "content": "5"},
            {"role": "assistant", "content": "The sum is 5."},
        ]


def test_a_template_error_drops_its_group_counted_and_the_run_goes_on(base_tokenizer):
    # A template that refuses every tool message: the groups that call a tool are dropped and counted, a group
    # without a tool call trains (on the code before, the first one ended the run with Jinja's error).
    refuses_tools = QWEN.replace(
        "{%- elif message.role == 'tool' %}\n    {%- if loop.first",
        "{%- elif message.role == 'tool' %}{{- raise_exception('no tool results here') }}\n    {%- if loop.first",
    )
    assert refuses_tools != QWEN
    loop = _loop(base_tokenizer, refuses_tools)
    metrics = _run_groups(loop, ["Two plus three, use the tool.", "Say hi.", "Three plus two, use the tool."])
    assert metrics["rollout/template_error_count"] == 2
    assert metrics["rollout/failed_group_count"] == 2 and loop.failed_groups == 2
    assert metrics["rollout/group_count"] == 1  # the plain question scored


def test_a_template_that_ignores_tool_calls_keeps_the_call_in_the_text(base_tokenizer):
    # tiny-qwen3's own ChatML template renders content only: the call must stay in the content, or it would vanish
    # from the second turn's prompt (and that turn would not extend the first: a fork, two samples per rollout).
    assert "tool_calls" not in base_tokenizer.chat_template
    loop = _loop(base_tokenizer, base_tokenizer.chat_template)
    metrics = _run_groups(loop, ["What is two plus three? Please use the tool."])
    assert "rollout/failed_group_count" not in metrics
    assert metrics["rollout/fork_frac"] == 0 and metrics["rollout/samples_per_rollout"] == 1
    first = loop.completions[0][0][0]
    assert first["content"] == CALL and first["tool_calls"][0]["function"]["name"] == "add"
    assert sum(CALL in text for text in loop.rendered) == 2  # in both rollouts' second prompts
