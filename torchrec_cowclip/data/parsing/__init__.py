"""Parsing pieces the source formats share: delimited text, typed fields, row layouts and
row blocks, the dense transforms, and the encodings of categorical values (exact
vocabulary, hashing)."""
