"""The request's edges: argument shapes, limits, tokenizer text, the scheduler's messages and the
output format, shared by the offline Engine and the HTTP server so both behave the same."""
