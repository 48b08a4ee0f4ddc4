#!/usr/bin/env python3
"""Renders chat records with Meta's Llama 3 Instruct chat template, the string of
Meta-Llama-3-8B-Instruct's tokenizer_config.json, in Jinja2 as transformers'
apply_chat_template does (a sandboxed environment with trim_blocks and lstrip_blocks,
bos_token "<|begin_of_text|>", add_generation_prompt false).

usage: chat_template_reference.py RECORDS.json OUT.json
RECORDS.json holds a list of records, each a list of {"role", "content"}; OUT.json
gets the list of rendered strings.
"""
import json
import sys

from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def main():
    records_path, out_path = sys.argv[1], sys.argv[2]
    with open(records_path, encoding="utf-8") as f:
        records = json.load(f)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(CHAT_TEMPLATE)
    out = [template.render(messages=r, bos_token="<|begin_of_text|>", add_generation_prompt=False) for r in records]
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
