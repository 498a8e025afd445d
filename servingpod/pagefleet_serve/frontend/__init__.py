"""The API side of an engine core: input processing (chat template, tokenization, bounds,
grammar check), output processing (the one detokenizer and stop-string pipeline) and the
core client. It never imports the engine core: it speaks to it in `messages`."""
