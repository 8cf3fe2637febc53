"""Data: the built-in corpus, `prepare` (tokenize + pack), and the packed-token reader."""
