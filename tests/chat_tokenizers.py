"""Byte-level BPE tokenizers with real chat templates, built in code (nothing from a hub):
a GPT-2-style one with a Qwen2.5-like ChatML template (tools, `<tool_call>` blocks, tool
responses) and a Llama-3-style one (header tokens, `<|eot_id|>`)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = ["what is two plus three", "the answer is five", "and what about four times six",
          "it is twenty four", "thanks , one more : seven minus one", "six",
          '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>',
          "you are a helpful assistant . tools : calc evaluates arithmetic expressions"] * 4

# HF renders with trim_blocks: a newline right after a tag is dropped, so newlines that
# follow one are written as expressions, as real templates do
CHATML = (
    "{%- if tools %}<|im_start|>system\nYou may call tools:\n<tools>"
    "{%- for t in tools %}{{ '\\n' }}{{ t | tojson }}{%- endfor %}"
    "{{ '\\n' }}</tools><|im_end|>{{ '\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{%- endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ m.content }}{{ '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' }}{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}"
    "{%- if m.content %}{{ '\\n' }}{%- endif %}{{ '<tool_call>\\n' }}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "{{ '\\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")

LLAMA3 = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}"
    "{{ m.content | trim }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def _bpe(special: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def chatml_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2-style byte-level BPE; turns end in <|im_end|> (its EOS, as Qwen's)."""
    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(["<|endoftext|>", "<|im_start|>",
                                                         "<|im_end|>"]),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def llama3_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-3-style: <|begin_of_text|>, header tokens, turns end in <|eot_id|>."""
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"]
    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(special), bos_token=special[0],
                                  eos_token="<|eot_id|>", pad_token=special[1])
    tok.chat_template = LLAMA3
    return tok
