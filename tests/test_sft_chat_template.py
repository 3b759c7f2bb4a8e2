"""--chat-template: SFT records (tools, assistant tool calls, tool turns, system prompts) rendered by
a Hugging Face tokenizer's chat template. The ids equal `apply_chat_template(messages, tools=...)`;
the loss mask is 1 on each assistant turn's content and tool calls with its end-of-turn token and
nowhere else, from generation markers or rendered prefixes (the same mask both ways); refusals.

Three templates in the styles of real ones (ChatML / Qwen3 with <tool_call>, Llama-3 with header
ids and ipython turns, Gemma / DiffusionGemma with <start_of_turn>model and generation markers),
written for these tests into the tokenizer_config.json of a byte-level BPE tokenizer trained here
(no hub download)."""
import json
import re

import pytest

pytest.importorskip("transformers")

from megatron_csbp.data.megatron_data import build_tokenizer  # noqa: E402
from megatron_csbp.data.sft import SFTDataset, chat_template, hugging_face_tokenizer, prompt_ids, render  # noqa: E402

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_function_call>", "<end_function_call>"]

QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions.\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
    "{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] %}{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + (tc.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{%- if messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

LLAMA3 = (
    "{{- bos_token }}{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}"
    "{%- set msgs = messages[1:] %}{%- else %}{%- set sys = '' %}{%- set msgs = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools %}{{- 'Environment: ipython\\n\\n' }}"
    "{%- endif %}{{- sys + '<|eot_id|>' }}"
    "{%- if tools %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\nFunctions:\\n\\n' }}{%- for t in tools %}"
    "{{- (t | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for m in msgs %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for tc in m.tool_calls %}{{- '{\"name\": \"' + tc.function.name + '\", \"parameters\": ' +"
    " (tc.function.arguments | tojson) + '}' }}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

GEMMA = (
    "{{- bos_token }}{%- if tools %}{{- '<start_of_turn>system\\nTools:\\n' }}{%- for t in tools %}"
    "{{- (t | tojson) + '\\n' }}{%- endfor %}{{- '<end_of_turn>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<start_of_turn>model\\n' }}{% generation %}"
    "{%- if m.content %}{{- m.content }}{%- endif %}"
    "{%- for tc in m.tool_calls or [] %}{{- '<start_function_call>call:' + tc.function.name +"
    " (tc.function.arguments | tojson) + '<end_function_call>' }}{%- endfor %}"
    "{{- '<end_of_turn>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<start_of_turn>' + m.role + '\\n' + m.content + '<end_of_turn>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
AGENT = {"tools": [WEATHER], "messages": [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
    {"role": "tool", "name": "get_weather", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny in Paris, 21 C."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."}]}
CALL_TEXT = {"qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
             "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
             "gemma": '<start_function_call>call:get_weather{"city": "Paris"}<end_function_call>'}
#: each template's supervised text of AGENT's three assistant turns (content, tool calls, end of turn)
EXPECTED = {
    "qwen3": ["Let me check.\n" + CALL_TEXT["qwen3"] + "<|im_end|>", "It is sunny in Paris, 21 C.<|im_end|>",
              "You are welcome.<|im_end|>"],
    "llama3": [CALL_TEXT["llama3"] + "<|eot_id|>", "It is sunny in Paris, 21 C.<|eot_id|>", "You are welcome.<|eot_id|>"],
    "gemma": ["Let me check." + CALL_TEXT["gemma"] + "<end_of_turn>", "It is sunny in Paris, 21 C.<end_of_turn>",
              "You are welcome.<end_of_turn>"],
}
TEMPLATES = {"qwen3": (QWEN3, None), "llama3": (LLAMA3, "<|begin_of_text|>"), "gemma": (GEMMA, "<bos>")}


@pytest.fixture(scope="module")
def hf_tok():
    from megatron_csbp.conversion.tiny import save_tiny_tokenizer
    import tempfile

    tok = save_tiny_tokenizer(tempfile.mkdtemp(prefix="sft_chat_"), vocab_size=384)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    return tok


def tokenizer_with(hf_tok, tmp_path, name, template=None):
    """The trainer's tokenizer of a folder whose tokenizer_config.json holds `name`'s template."""
    text, bos = TEMPLATES[name]
    hf_tok.chat_template = text if template is None else template
    hf_tok.bos_token = bos
    folder = tmp_path / name
    hf_tok.save_pretrained(str(folder))
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text()) or \
        (folder / "chat_template.jinja").exists()
    return build_tokenizer("HuggingFaceTokenizer", str(folder), None)


def supervised_runs(tok, ids, mask):
    runs, cur = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.detokenize(cur))
            cur = []
    return runs


@pytest.mark.parametrize("name", ["qwen3", "llama3", "gemma"])
def test_ids_are_the_templates_and_masks_cover_assistant_turns(hf_tok, tmp_path, name):
    tok = tokenizer_with(hf_tok, tmp_path, name)
    template = chat_template(tok, "auto")
    assert template is not None and template.markers == (name == "gemma")
    ids, mask = render(AGENT, tok, "agent.jsonl:1", template)
    expect = hugging_face_tokenizer(tok).apply_chat_template(AGENT["messages"], tools=AGENT["tools"], tokenize=True, return_dict=True)
    assert ids == list(expect["input_ids"])
    assert supervised_runs(tok, ids, mask) == EXPECTED[name]
    clean = tok.detokenize([i for i, m in zip(ids, mask) if not m])
    for text in ("You are a helpful agent.", "What is the weather in Paris?", "sunny, 21 C", "Thanks!", "get_weather"):
        assert text in clean  # system, user and tool turns (and the tool schema) stay unsupervised
    # A prompt/response pair is a one-turn conversation; generation prompts come from the same template.
    ids, mask = render({"prompt": "Hi", "response": "Hello."}, tok, "x", template)
    p = prompt_ids("Hi", tok, template)
    assert ids[:len(p)] == p and mask[:len(p)] == [0] * len(p) and mask[len(p)] == 1
    assert p == list(hugging_face_tokenizer(tok).apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])


def test_markers_and_prefixes_give_the_same_mask(hf_tok, tmp_path):
    tok = tokenizer_with(hf_tok, tmp_path, "gemma")
    marked = chat_template(tok, "auto")
    plain_file = tmp_path / "gemma_no_markers.jinja"
    plain_file.write_text(re.sub(r"\{% (end)?generation %\}", "", GEMMA))
    plain = chat_template(tok, str(plain_file))
    assert marked.markers and not plain.markers
    assert render(AGENT, tok, "x", marked) == render(AGENT, tok, "x", plain)
    text = chat_template(tok, plain_file.read_text())  # the template's text itself, as Megatron-LM's flag takes it
    assert render(AGENT, tok, "x", text) == render(AGENT, tok, "x", plain)


def test_dataset_logs_the_rendering_and_refuses_in_one_line(hf_tok, tmp_path):
    from megatron_csbp.data.sft import describe_rendering

    tok = tokenizer_with(hf_tok, tmp_path, "qwen3")
    template = chat_template(tok, "auto")
    assert "chat template" in describe_rendering(template) and "plain" in describe_rendering(None)
    path = tmp_path / "agent.jsonl"
    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": "nope"}
    path.write_text(json.dumps(AGENT) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"agent.jsonl:2: tools must be a list"):
        SFTDataset(str(path), tok, 512, template=template)
    # A template that raises (as real ones do for roles they do not know) is named with the line.
    raising = tmp_path / "raising.jinja"
    raising.write_text("{%- for m in messages %}{%- if m.role == 'tool' %}{{ raise_exception('no tool role') }}"
                       "{%- endif %}{{ m.content }}{%- endfor %}")
    path.write_text(json.dumps(AGENT) + "\n")
    with pytest.raises(ValueError, match=r"agent.jsonl:1: the chat template cannot render this record \(.*no tool role"):
        SFTDataset(str(path), tok, 512, template=chat_template(tok, str(raising)))
    # A template that renders an earlier turn differently once later turns follow (Qwen3 drops the
    # thinking of earlier turns) has no prefix-derived mask.
    dropping = tmp_path / "dropping.jinja"
    dropping.write_text("{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}<think></think>{%- endif %}"
                        "{{ m.role + ': ' + (m.content or '') + '<|im_end|>' }}{%- endfor %}"
                        "{%- if add_generation_prompt %}assistant: {%- endif %}")
    with pytest.raises(ValueError, match="agent.jsonl:1: the chat template renders turn 2 differently"):
        SFTDataset(str(path), tok, 512, template=chat_template(tok, str(dropping)))


def test_plain_rendering_refuses_tools_and_the_flag_is_checked(tmp_path, capsys):
    from megatron_csbp.training.arguments import parse_args

    sp = build_tokenizer("SentencePieceTokenizer", None, None)
    assert chat_template(sp, "auto") is None  # no template: the plain rendering
    with pytest.raises(ValueError, match="tool calls and tool turns need a chat template"):
        render(AGENT, sp, "agent.jsonl:1", None)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    base = ["--sft-data-path", str(path), "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "32", "--block-size", "8", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1"]
    for extra, line in ((["--chat-template", str(tmp_path / "missing.jinja"), "--tokenizer-type",
                          "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)], "no such file"),
                        (["--chat-template", str(path)], "a template file needs --tokenizer-type HuggingFaceTokenizer")):
        with pytest.raises(SystemExit):
            parse_args(base + extra, world_size=1)
        assert f"--chat-template {extra[1]}: {line}" in capsys.readouterr().err


def test_inspect_shows_rendered_records_with_supervised_spans(hf_tok, tmp_path, capsys):
    from megatron_csbp.data.inspect import main

    tok = tokenizer_with(hf_tok, tmp_path, "qwen3")
    path = tmp_path / "agent.jsonl"
    path.write_text(json.dumps(AGENT) + "\n\n" + json.dumps({"prompt": "Hi", "response": "Hello."}) + "\n")
    flags = ["--sft-data-path", str(path), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
             str(tmp_path / "qwen3")]
    assert main(flags + ["--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["line"] for r in rows] == [1, 3]
    assert (rows[0]["input_ids"], rows[0]["loss_mask"]) == render(AGENT, tok, "x", chat_template(tok, "auto"))
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "rendered with the tokenizer's chat template" in out
    for text in EXPECTED["qwen3"]:
        assert "[[" + text + "]]" in out
    assert main(flags + ["--chat-template", "none"]) == 2  # tool calls have no plain rendering
    assert "agent.jsonl:1: tools, tool calls and tool turns need a chat template" in capsys.readouterr().err
