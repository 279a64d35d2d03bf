"""Chat templates that render history otherwise than it was sampled, on SmolLM2's ChatML tokens: what
`benchmarks/template_history.py` runs episodes under and what tests/test_chat.py and
tests/test_template_history.py check `rollout.chat.ChatTokens` against (docs/design.md, "Episodes").

    DROPS_REASONING     Qwen3's multi-turn rule: an assistant message that is not the last one loses
                        its <think> reasoning
    QWEN3_NO_THINKING   the same, with Qwen3's non-thinking generation prompt (an empty reasoning block,
                        which the rendering of an earlier turn leaves out)
    TRIMS               Llama 3's rule: every content trimmed of surrounding whitespace
"""

DROPS_REASONING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n' + m['content'].split('</think>')[-1].lstrip() + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN3_NO_THINKING = DROPS_REASONING[:DROPS_REASONING.index("{% if add_generation_prompt %}")] + (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{% endif %}")
TRIMS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + '<|im_end|>\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
