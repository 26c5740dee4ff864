"""What the hostile-input guards cost on good input and how soon they stop bad input, in seconds on this machine.

    python -m bench.guards [--repetitions 20]

The tests assert what the guards do (which guard stops what, with a fake clock or a count of work); the speed is a
property of the machine, so it is measured here instead, as JSON:

* ``templates``: each real chat template rendered in the bounded sandbox over a 400-message conversation with 20
  tools (the median of the repetitions), next to the time budget a render has (``TIME_BUDGET``);
* ``pathological_regex``: compiling ``(a|b)*a(a|b){40}`` (2^40 DFA states if built eagerly) and taking a mask at
  each of 60 tokens, under llguidance's lexer fuel.
"""

from __future__ import annotations

import json
import statistics
import time

import click

# What real templates do (ChatML, Llama 2's [INST], a system prompt gathered through a namespace, filters, tools).
REAL_TEMPLATES = [
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{{ bos_token }}{% for m in messages %}{{ '[INST] ' ~ m['content'] ~ ' [/INST]' if m['role'] == 'user' "
    "else m['content'] ~ eos_token }}{% endfor %}",
    "{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.system = ns.system ~ m['content'] %}{% endif %}{% endfor %}{{ ns.system }}|{{ messages|length }}",
    "{{ messages|map(attribute='content')|join('\n') }}{{ (messages|selectattr('role', 'eq', 'user')|list)|length }}",
    "{% if tools %}{{ tools|tojson(indent=2) }}{% endif %}{{ '%s:%d'|format('a', 3) }}{{ '{}-{}'.format(1, 2) }}",
]


def long_conversation(turns: int = 400, tools: int = 20) -> tuple[list[dict], list[dict]]:
    """(messages, tools): a system prompt, ``turns`` alternating turns of 40 words, ``tools`` function tools."""
    messages = [{"role": "system", "content": "be brief"}] + [
        {"role": "user" if i % 2 else "assistant", "content": f"message {i} " * 40} for i in range(turns)
    ]
    functions = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(tools)
    ]
    return messages, functions


def _median_seconds(run, repetitions: int) -> float:
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 6)


def template_figures(repetitions: int) -> dict:
    from runtime.text.chat_template import TIME_BUDGET, render_chat_template

    messages, tools = long_conversation()

    def render(template: str):
        return lambda: render_chat_template(template, messages, tools=tools, bos_token="<s>", eos_token="</s>")

    seconds = [_median_seconds(render(template), repetitions) for template in REAL_TEMPLATES]
    return {"time_budget_s": TIME_BUDGET, "messages": len(messages), "render_s": seconds}


def regex_figure(repetitions: int) -> dict:
    """A byte-level tokenizer (one token per byte) constrained by the pathological regex."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from runtime.decoding.grammar import Constraint, GrammarCompiler

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=257,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["ab"], trainer)

    def run() -> None:
        compiler = GrammarCompiler(tokenizer.to_str(), 257, (0,))  # the special token comes first
        row = compiler.compile(Constraint("regex", "(a|b)*a(a|b){40}")).start()
        drafted: list[int] = []
        for token in compiler.tokenizer.tokenize_str("ab" * 30):
            row.mask_after(drafted)
            drafted.append(token)

    return {"regex": "(a|b)*a(a|b){40}", "masks": 60, "compile_and_masks_s": _median_seconds(run, repetitions)}


@click.command()
@click.option("--repetitions", type=int, default=20, show_default=True, help="Runs per figure (the median is kept).")
def main(repetitions: int) -> None:
    """Time the hostile-input guards on good and bad input; JSON on stdout."""
    report = {"templates": template_figures(repetitions), "pathological_regex": regex_figure(max(1, repetitions // 4))}
    click.echo(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
