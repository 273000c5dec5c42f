"""Tool calls read by transformers' response parsing (the tokenizer's ``response_template``), other model families'
formats included, and the Hermes regex fallback for tokenizers without a template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from grpo_core.config import ModelConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.models import resolve_model_dir
from grpo_core.rollout.tools import RESPONSE_TEMPLATES, parse_tool_calls, resolve_response_template


@pytest.fixture
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig(name="tiny-qwen3")))


def _calls(calls):
    return [(c.name, c.arguments, c.error is None) for c in calls]


def test_without_a_template_the_hermes_regex_reads_the_calls(tokenizer):
    assert getattr(tokenizer, "response_template", None) is None
    text = 'I will add.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert _calls(parse_tool_calls(text, tokenizer)) == [("add", {"a": 1, "b": 2}, True)]
    # A Mistral-style call is not Hermes: without a template it is not read.
    assert parse_tool_calls('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', tokenizer) == []


def test_mistral_tool_calls_are_parsed_through_the_tokenizers_response_template(tokenizer):
    tokenizer.response_template = resolve_response_template("mistral")
    text = (
        'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "neg", "arguments": {"x": 3}}]</s>'
    )
    assert _calls(parse_tool_calls(text, tokenizer)) == [("add", {"a": 1, "b": 2}, True), ("neg", {"x": 3}, True)]
    # Token ids (special tokens kept) parse the same as the text, with the prompt as prefix.
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("[INST] add 1 and 2 [/INST]", add_special_tokens=False)
    assert _calls(parse_tool_calls("ignored", tokenizer, ids, prompt)) == _calls(parse_tool_calls(text, tokenizer))
    broken = parse_tool_calls('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}', tokenizer)
    assert len(broken) == 1 and broken[0].error is not None and "JSON" in broken[0].error
    assert parse_tool_calls("No tool needed: 3.</s>", tokenizer) == []


def test_llama3_and_hermes_templates(tokenizer):
    tokenizer.response_template = resolve_response_template("llama3")
    text = '<|python_tag|>{"name": "lookup", "parameters": {"city": "Oslo"}}<|eom_id|>'
    assert _calls(parse_tool_calls(text, tokenizer)) == [("lookup", {"city": "Oslo"}, True)]
    tokenizer.response_template = RESPONSE_TEMPLATES["hermes"]
    text = (
        '<think>need a sum</think>Adding.\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
        "<|im_end|>"
    )
    assert _calls(parse_tool_calls(text, tokenizer)) == [("add", {"a": 1}, True)]  # string arguments decoded


def test_a_custom_template_dict_is_checked_and_bad_ones_are_refused():
    custom = {
        "start_anchor": "<reply>",
        "fields": {"content": {"content": "text"}, "tool_calls": {"open": "CALL:", "content": "json", "repeats": True}},
    }
    assert resolve_response_template(custom) is custom
    with pytest.raises(ConfigError, match="not a built-in template"):
        resolve_response_template("gpt-9")
    with pytest.raises(ConfigError, match="not a valid transformers response template"):
        resolve_response_template({"fields": {"content": {"content": "text"}}})  # no start_anchor
    cfg = load_config(None, ["rollout.response_template=mistral"])
    assert resolve_response_template(cfg.rollout.response_template) is RESPONSE_TEMPLATES["mistral"]
