"""`ngram`: prompt lookup decoding, training-free (docs/methods/ngram.md)."""

from selfdraft.methods import Method

METHOD = Method(name="ngram", drafter=".drafter:NgramDrafter")
