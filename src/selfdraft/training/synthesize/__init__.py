"""Synthesized training data: the target writes its own user prompts (and follow-up turns), gated,
then answers them (docs/data.md#synthesized-prompts-data-with-no-dataset).

An instruction-tuned model continues its chat template's user header with a realistic user request
(Magpie, arXiv 2406.08464). For a drafter that is ideal data: prompt and answer are both the
target's own distribution, and no dataset is needed at all.

  config.py      the settings (GateConfig, SynthConfig)
  domains.py     the steering system prompts and seed topics of chat, code, math
  gates.py       the quality gates and their counts
  neardup.py     exact word n-gram Jaccard search (prefix filter), for dedup and the eval guard
  references.py  the prompts of evaluation sets and excluded datasets
  loop.py        the resumable loop: write prompts, gate, answer, turn by turn; records + log
"""
