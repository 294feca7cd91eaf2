"""`suffix`: SuffixDecoding, training-free (docs/methods/suffix.md): frequency-weighted drafts from a
suffix tree over the request's prompt + output and a global one over earlier responses."""

from selfdraft.methods import Method

METHOD = Method(name="suffix", drafter=".drafter:SuffixDrafter")
